"""Preference fine-tuning (``train_config.stage: dpo``): pair data, reference log-probs and the DPO, IPO,
SimPO and ORPO losses. The DPO recipe (recipes/dpo.py) builds its data, objective and reference from
these pieces and trains with the shared step; docs/preference.md describes the whole feature.
"""
