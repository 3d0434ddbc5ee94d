"""The Paddle Inference predictor runs on the chosen GPU, not always GPU 0."""

from bmtrain_cli.export.paddle_inference import predictor_device_id


def test_device_id_follows_the_current_device():
    assert predictor_device_id(device="gpu:3") == 3
    assert predictor_device_id(device="gpu") == 0
    assert predictor_device_id(device="cpu") == 0
    assert predictor_device_id(2, device="gpu:5") == 2  # an explicit id wins
