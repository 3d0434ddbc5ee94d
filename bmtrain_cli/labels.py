"""The label convention every part shares (data, models, kernels, parallel, evaluation): ``labels`` are
unshifted token ids (position t predicts labels[t + 1]) and IGNORE_INDEX marks a token that is not scored.

Kernel signatures that paddle.jit.to_static(full_graph=True) compiles spell the value ``-100`` instead:
it cannot resolve a module constant there.
"""

IGNORE_INDEX = -100
