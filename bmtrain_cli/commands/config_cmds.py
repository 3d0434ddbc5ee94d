"""`bmtrain validate-config` and `bmtrain schema`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from bmtrain_cli.commands.common import set_option, user_errors


def write_example(name: Optional[str], output: Optional[Path], force: bool) -> None:
    """`bmtrain init`: list the packaged example configs, or copy one to ``output``."""
    from bmtrain_cli.config.examples import describe, example_path, examples
    from bmtrain_cli.errors import UserError

    found = examples()
    if not found:
        raise UserError("this installation carries no example configs (reinstall bmtrain-cli)")
    if name is None:
        typer.echo("example configs (bmtrain init NAME writes NAME.yaml; --config NAME runs one as is):")
        for stem, path in found.items():
            typer.echo(f"  {stem:<26} {describe(path)}")
        return
    source = example_path(name)
    if source is None:
        raise UserError(f"no example config named {name!r}; choose one of: {', '.join(found)}")
    target = output or Path(f"{source.stem}.yaml")
    if target.is_dir():
        target = target / f"{source.stem}.yaml"
    if target.exists() and not force:
        raise UserError(f"{target} exists; pass --force to replace it, or --output another file")
    try:
        # the header's "Run:" line names the file as it lies in a checkout; name the written one instead
        text = source.read_text(encoding="utf-8").replace(f"configs/{source.stem}.yaml", str(target))
        target.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot write {target}: {exc.strerror or exc}") from None
    typer.echo(f"wrote {target} ({describe(source)})")
    typer.echo(f"run it: bmtrain train --config {target}")


def register(app: typer.Typer) -> None:
    @app.command("validate-config")
    @user_errors
    def validate_config(
        config: Optional[Path] = typer.Argument(None, help="The config YAML file."),
        config_opt: Optional[Path] = typer.Option(
            None, "--config", "-c", help="The config YAML file (same as the argument, as in `bmtrain train`)."
        ),
        set_: Optional[List[str]] = set_option(),
        as_json: bool = typer.Option(False, "--json", help="Print the resolved summary as JSON."),
    ) -> None:
        """Check a config file and print the resolved summary; exit 2 listing every problem."""
        from bmtrain_cli.commands.summary import format_summary, summarize
        from bmtrain_cli.config import load_config
        from bmtrain_cli.errors import UserError

        if config is not None and config_opt is not None and config != config_opt:
            raise UserError("give the config once: as the argument or as --config, not both")
        config = config or config_opt
        if config is None:
            raise UserError("no config given: bmtrain validate-config CONFIG.yaml (or --config CONFIG.yaml)")
        loaded = load_config(str(config), set_ or [], mode="validate", require_data=True)
        if as_json:
            from bmtrain_cli.commands.summary import with_known_vocab

            out = summarize(with_known_vocab(loaded.config)[0])
            out["warnings"] = [w.format() for w in loaded.warnings]
            typer.echo(json.dumps(out, indent=2))
            return
        for line in format_summary(loaded.config, str(config)):
            typer.echo(line)
        for w in loaded.warnings:
            typer.echo("  " + w.format(), err=True)

    @app.command("init")
    @user_errors
    def init(
        name: Optional[str] = typer.Argument(
            None, help="The example to write (quickstart, llama-tiny-lora, ...); none: list them."
        ),
        output: Optional[Path] = typer.Option(
            None, "--output", "-o", help="The file to write (default: NAME.yaml in the current directory)."
        ),
        force: bool = typer.Option(False, "--force", help="Replace the output file if it exists."),
    ) -> None:
        """Write a starter config from the examples that ship with the package (none named: list them)."""
        write_example(name, output, force)

    @app.command("schema")
    @user_errors
    def schema(
        output: Optional[Path] = typer.Option(
            None, "--output", "-o", help="Write to a file instead of stdout."
        ),
    ) -> None:
        """Print the JSON Schema of the config file (for editor autocompletion)."""
        from bmtrain_cli.config.schema import json_schema

        text = json.dumps(json_schema(), indent=2)
        if output:
            from bmtrain_cli.errors import UserError

            if output.is_dir():
                raise UserError(f"--output {output} is a directory; name the file to write")
            try:
                output.write_text(text + "\n", encoding="utf-8")
            except OSError as exc:
                raise UserError(f"cannot write --output {output}: {exc.strerror or exc}") from None
            typer.echo(f"wrote {output}")
        else:
            typer.echo(text)
