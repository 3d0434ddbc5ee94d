"""An lm-evaluation-harness model for our checkpoints, no export needed: ``bmtrain`` with
``--model_args path=DIR[,batch_size=8,dtype=float32,tokenizer_path=DIR]``.

lm-eval finds models in its registry, filled by ``register_model`` when the defining module is imported
(lm-eval 0.4 reads no entry points for models). Importing this module registers ``bmtrain``;
``bmtrain-lm-eval`` is lm-eval's own command line with it imported first:

    bmtrain-lm-eval --model bmtrain --model_args path=output/checkpoints/step-500 --tasks mmlu

Log-likelihoods go through bmtrain_cli/models/scoring.py (the same numbers as ``bmtrain eval --task``);
generation through bmtrain_cli/models/generate.py (greedy, or sampled with ``temperature``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional, Tuple

import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from bmtrain_cli.labels import IGNORE_INDEX


@register_model("bmtrain")
class BmtrainLM(TemplateLM):
    def __init__(
        self,
        path: str,
        batch_size: int = 8,
        dtype: str = "float32",
        tokenizer_path: Optional[str] = None,
        max_length: Optional[int] = None,
        **_: Any,
    ) -> None:
        super().__init__()
        from bmtrain_cli.export.any_model import load_model_and_tokenizer

        self.model, self.tokenizer = load_model_and_tokenizer(
            Path(path), Path(tokenizer_path) if tokenizer_path else None, dtype
        )
        self.batch_size = int(batch_size)
        self.max_length = int(max_length or self.model.arch.max_position_embeddings)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_id
        return bos if bos is not None else self.tokenizer.eos_id

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **_: Any) -> List[int]:
        ids = list(self.tokenizer.encode(string))
        add = getattr(self.tokenizer, "add_bos", False) if add_special_tokens is None else add_special_tokens
        return [self.tokenizer.bos_id, *ids] if add and self.tokenizer.bos_id is not None else ids

    def _loglikelihood_tokens(self, requests: List[Any], disable_tqdm: bool = False, **_: Any) -> List[Tuple]:
        from bmtrain_cli.models.scoring import sample_logps

        samples = []
        for _key, context_enc, continuation_enc in requests:
            # lm-eval's cut: max_length + 1 tokens, the last only a target
            whole = (list(context_enc) + list(continuation_enc))[-(self.max_length + 1) :]
            ids = np.asarray(whole, dtype=np.int64)
            labels = ids.copy()
            labels[: len(ids) - len(continuation_enc)] = IGNORE_INDEX
            samples.append((ids, labels))
        logps, greedy = sample_logps(self.model, samples, self.batch_size, greedy=True)
        out = [(float(lp), bool(g)) for lp, g in zip(logps, greedy)]
        for (key, _c, _t), result in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return out

    def loglikelihood_rolling(self, requests: List[Any], disable_tqdm: bool = False) -> List[float]:
        out = []
        for (string,) in [r.args for r in requests]:
            windows = get_rolling_token_windows(
                self.tok_encode(string, add_special_tokens=False), self.prefix_token_id, self.max_length, 1
            )
            pairs = [(None, *make_disjoint_window(w)) for w in windows]
            out.append(sum(lp for lp, _ in self._loglikelihood_tokens(pairs)))
        return out

    def generate_until(self, requests: List[Any], disable_tqdm: bool = False) -> List[str]:
        from bmtrain_cli.models.decoding import SamplingOptions
        from bmtrain_cli.models.generate import generate

        out = []
        for context, gen_kwargs in [r.args for r in requests]:
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            ids = self.tok_encode(context)
            room = max(1, self.max_length - len(ids))
            n = min(int(gen_kwargs.get("max_gen_toks", 256)), room)
            temperature = float(gen_kwargs.get("temperature", 0.0)) if gen_kwargs.get("do_sample") else 0.0
            options = SamplingOptions(
                max_new_tokens=n, temperature=temperature, eos_token_id=self.eot_token_id
            )
            new = generate(self.model, [ids[-self.max_length + 1 :]], options)
            text = self.tokenizer.decode([t for t in new[0] if t != self.eot_token_id])
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out


def main() -> None:
    """lm-eval's command line with the ``bmtrain`` model registered (the ``bmtrain-lm-eval`` script)."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
