"""`bmtrain prepare-data` (tokenise once into the cache) and `bmtrain data-stats` (read and report)."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, List, Optional, Tuple, Union

import typer

from bmtrain_cli.commands.common import config_tokenizer_option, set_option, user_errors
from bmtrain_cli.errors import UserError
from bmtrain_cli.methods import method_of

if TYPE_CHECKING:
    from bmtrain_cli.preference.loader import PreferenceLoader


def _overrides(set_: Optional[List[str]], data_path: Optional[str]) -> List[str]:
    out = list(set_ or [])
    if data_path is not None:
        out.append(f"train_config.data_path={data_path}")
    return out


def resolve_tokenizer(config: Any, tokenizer: Optional[str]) -> Any:
    from bmtrain_cli.data.tokenizers import load_tokenizer

    m = config.model
    path = tokenizer or m.tokenizer_path or m.model_name_or_path
    if path:
        return load_tokenizer(path)
    out = Path(config.train.output_dir) / "tokenizer"
    if out.exists():
        return load_tokenizer(str(out))
    raise UserError(
        "no tokenizer: set model_config.tokenizer_path (or model_name_or_path), or pass --tokenizer "
        f"(for a fresh model, `bmtrain train` trains a sentencepiece tokenizer into {out}, used here after)"
    )


@contextlib.contextmanager
def _load(
    config_path: Path, set_: Optional[List[str]], data_path: Optional[str], tokenizer: Optional[str]
) -> Iterator[Tuple[Any, Any]]:
    """(config, tokenizer) of the data the trainer would read: a demo config's generated task (in a
    temporary directory, deterministic: `bmtrain train` generates the same under output_dir/data)."""
    from bmtrain_cli.config import load_config
    from bmtrain_cli.plan.data_facts import generated_inputs

    cfg = load_config(str(config_path), _overrides(set_, data_path), mode="validate").config
    if cfg.train.data_path is None and not cfg.train.demo_data:
        raise UserError("no training data: set train_config.data_path or pass --data_path")
    if cfg.train.data_path is not None:
        yield cfg, resolve_tokenizer(cfg, tokenizer)
        return
    with generated_inputs(cfg) as inputs:
        if method_of(cfg.train).sample == "pair":  # the preference demo: pairs of the same strings
            from bmtrain_cli.preference.demo import write_demo_pairs

            pairs = Path(inputs["tmp"]) / "pairs"
            assert cfg.train.demo_data is not None  # no data_path: the demo data (checked above)
            write_demo_pairs(str(pairs), task=cfg.train.demo_data, seed=0)
            inputs["data"] = str(pairs / "pairs_train.jsonl")
        typer.echo(
            f"demo_data: {cfg.train.demo_data}: reading the generated task in a temporary directory (not "
            f"kept; `bmtrain train` generates the same under {Path(cfg.train.output_dir) / 'data'})",
            err=True,
        )
        train = cfg.train.model_copy(update={"data_path": inputs["data"]})
        cfg = cfg.model_copy(update={"train": train})
        yield cfg, resolve_tokenizer(cfg, tokenizer or inputs["tokenizer"])


def _sampled_stats(cfg: Any, tok: Any, n: int) -> Any:
    from bmtrain_cli.data.encode import make_encoder
    from bmtrain_cli.data.loader import Dataset, loader_for
    from bmtrain_cli.data.readers import as_list, resolve_source
    from bmtrain_cli.data.sample import sample_records, sample_store
    from bmtrain_cli.data.stats import data_stats
    from bmtrain_cli.data.stream_setup import data_workers
    from bmtrain_cli.data.turns import options_of
    from bmtrain_cli.data.workers import EncodeSpec

    t = cfg.train
    files = [f for spec in as_list(t.data_path) for f in resolve_source(spec)]
    smp = sample_records(files, n, seed=t.seed)
    spec = EncodeSpec.of(make_encoder(tok, t.template, t.train_on_prompt, options_of(t)), t.data_format)
    store = sample_store(smp, spec, data_workers(t))
    if len(store) == 0:
        raise UserError(f"no usable record among the {store.records} sampled")
    st = data_stats(loader_for(cfg, tok, Dataset([store], [0], 1)))
    mean_bytes = sum(len(raw or b"") for _, _, raw in smp.items) / max(1, len(smp.items))
    st["files"] = files
    st["sample"] = {
        "records": store.records,
        "data_bytes": smp.bytes_total,
        "estimated_records": int(smp.bytes_total / mean_bytes)
        if mean_bytes and not smp.read_through
        else None,
        "read_through": smp.read_through,
    }
    return st


def _prepare(cfg: Any, tok: Any) -> None:
    """prepare-data: tokenise each split into the token cache and say what was done."""
    from bmtrain_cli.data.loader import Loader, build_loader

    if cfg.train.streaming is True:
        typer.echo("note: this config streams (streaming: true), so training will not read this cache")
    splits = ["train"] + (["eval"] if cfg.train.eval_data_path else [])
    for split in splits:
        t0 = time.perf_counter()
        loader: Union[PreferenceLoader, Loader]
        if method_of(cfg.train).sample == "pair":  # preference pairs (docs/preference.md)
            from bmtrain_cli.preference.loader import build_preference_loader

            loader = build_preference_loader(cfg, tok, split=split)
        else:
            cached = build_loader(cfg, tok, split=split, streaming=False)
            assert isinstance(cached, Loader)  # streaming=False: always the token cache
            loader = cached
        st = loader.stats()
        for s in loader.dataset.stores:
            state = "tokenised" if s.built else "reused"
            typer.echo(
                f"{split}: {s.file}: {len(s)} samples, {int(s.offsets[-1])} tokens -> {s.directory} ({state})"
            )
        typer.echo(
            f"{split}: {st['records']} records, {st['samples']} usable, {st['rejected']} rejected, "
            f"{st['tokens']} tokens after truncation to max_seq_len {cfg.model.max_seq_len} "
            f"({st['overlong']} samples longer) in {time.perf_counter() - t0:.2f}s"
        )


def register(app: typer.Typer) -> None:
    _register_preview(app)

    @app.command("prepare-data")
    @user_errors
    def prepare_data(
        config: Path = typer.Option(..., "--config", "-c", help="The config YAML file."),
        data_path: Optional[str] = typer.Option(None, "--data_path", "--data-path", help="Training JSONL."),
        tokenizer: Optional[str] = config_tokenizer_option(),
        set_: Optional[List[str]] = set_option(),
    ) -> None:
        """Validate and tokenise the training (and eval) data once into the memory-mapped token cache."""
        with _load(config, set_, data_path, tokenizer) as (cfg, tok):
            _prepare(cfg, tok)

    @app.command("data-stats")
    @user_errors
    def data_stats_cmd(
        config: Path = typer.Option(..., "--config", "-c", help="The config YAML file."),
        data_path: Optional[str] = typer.Option(None, "--data_path", "--data-path", help="JSONL to inspect."),
        tokenizer: Optional[str] = config_tokenizer_option(),
        set_: Optional[List[str]] = set_option(),
        as_json: bool = typer.Option(False, "--json", help="Print the statistics as JSON."),
        sample: Optional[int] = typer.Option(
            None,
            "--sample",
            min=1,
            max=10_000_000,
            help="Tokenise N records drawn at random instead of every record (at most 10,000,000).",
        ),
    ) -> None:
        """Print counts, token-length percentiles, truncation and padding waste (of every record, or of a
        random sample with --sample N)."""
        from bmtrain_cli.data.loader import build_loader
        from bmtrain_cli.data.stats import data_stats, format_stats, tool_stats

        with _load(config, set_, data_path, tokenizer) as (cfg, tok):
            if method_of(cfg.train).sample == "pair":
                raise UserError(
                    "data-stats reads SFT data; for stage: dpo, `bmtrain prepare-data` checks the pairs"
                )
            if sample is not None:
                st = _sampled_stats(cfg, tok, sample)
            else:
                st = data_stats(build_loader(cfg, tok, streaming=False))
            st["tools"] = tool_stats(st["files"], cfg.train.data_format)
        if as_json:
            typer.echo(json.dumps(st, indent=2))
            return
        for line in format_stats(st):
            typer.echo(line)


def _register_preview(app: typer.Typer) -> None:
    @app.command("data-preview")
    @user_errors
    def data_preview_cmd(
        config: Path = typer.Option(..., "--config", "-c", help="The config YAML file."),
        n: int = typer.Option(3, "-n", min=1, max=10_000, help="Records to show."),
        data_path: Optional[str] = typer.Option(None, "--data_path", "--data-path", help="Data to show."),
        tokenizer: Optional[str] = config_tokenizer_option(),
        set_: Optional[List[str]] = set_option(),
    ) -> None:
        """Print the first records as the model sees them, trained tokens marked (colour on a terminal,
        [[brackets]] when piped), with their token counts."""
        import sys

        from bmtrain_cli.commands.data_preview import preview

        with _load(config, set_, data_path, tokenizer) as (cfg, tok):
            for line in preview(cfg, tok, n, sys.stdout.isatty()):
                typer.echo(line)
