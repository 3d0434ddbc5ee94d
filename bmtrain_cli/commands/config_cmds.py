"""`bmtrain validate-config` and `bmtrain schema`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from bmtrain_cli.commands.common import set_option, user_errors


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
        from bmtrain_cli.config import load_config
        from bmtrain_cli.config.summary import format_summary, summarize
        from bmtrain_cli.errors import UserError

        if config is not None and config_opt is not None and config != config_opt:
            raise UserError("give the config once: as the argument or as --config, not both")
        config = config or config_opt
        if config is None:
            raise UserError("no config given: bmtrain validate-config CONFIG.yaml (or --config CONFIG.yaml)")
        loaded = load_config(str(config), set_ or [], mode="validate")
        if as_json:
            out = summarize(loaded.config)
            out["warnings"] = [w.format() for w in loaded.warnings]
            typer.echo(json.dumps(out, indent=2))
            return
        for line in format_summary(loaded.config, str(config)):
            typer.echo(line)
        for w in loaded.warnings:
            typer.echo("  " + w.format(), err=True)

    @app.command("schema")
    @user_errors
    def schema(
        output: Optional[Path] = typer.Option(
            None, "--output", "-o", help="Write to a file instead of stdout."
        ),
    ) -> None:
        """Print the JSON Schema of the config file (for editor autocompletion)."""
        from bmtrain_cli.config.schema import Config

        text = json.dumps(Config.model_json_schema(by_alias=True), indent=2)
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
