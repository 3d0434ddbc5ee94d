"""`bmtrain plan`: per-device memory of a config's layout, and a search for the fastest layout that fits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import typer

from bmtrain_cli.commands.common import set_option, user_errors


def register(app: typer.Typer) -> None:
    @app.command("plan")
    @user_errors
    def plan(
        config: Path = typer.Option(..., "--config", "-c", help="The config YAML file."),
        gpus: Optional[int] = typer.Option(
            None, "--gpus", min=1, help="Devices per node (default: the config's world size)."
        ),
        gpu_memory: Optional[str] = typer.Option(
            None, "--gpu_memory", "--gpu-memory", help="Memory per device with its unit: 80GiB, 80GB."
        ),
        nodes: int = typer.Option(1, "--nodes", min=1, help="Number of nodes."),
        device: Optional[str] = typer.Option(
            None,
            "--device",
            help="Device preset: A100-40GB, A100-80GB, H100-80GB, H200, V100-32GB, L40S, RTX4090, cpu.",
        ),
        do_search: bool = typer.Option(
            False, "--search", help="Search the layouts that fit and rank them by step time."
        ),
        top: int = typer.Option(8, "--top", min=1, help="Layouts to list with --search."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON."),
        set_: Optional[List[str]] = set_option(),
    ) -> None:
        """Estimate per-device memory (parameters, gradients, optimizer states, activations, logits,
        buffers) and whether it fits; with --search, print the fastest layout that fits as a config block."""
        from bmtrain_cli.config import load_config
        from bmtrain_cli.errors import UserError
        from bmtrain_cli.plan.devices import format_bytes, get_device
        from bmtrain_cli.plan.estimator import Layout, Workload, default_device, estimate_layout
        from bmtrain_cli.plan.search import longest_sequence, search, yaml_block

        loaded = load_config(str(config), set_ or [], mode="validate")
        cfg = loaded.config
        world = cfg.parallel.world_size
        if device is None:
            wants_gpu = gpus is not None or gpu_memory is not None
            dev = get_device("A100-80GB", gpu_memory) if wants_gpu else default_device(cfg)
        else:
            dev = get_device(device, gpu_memory)
        if dev.kind == "gpu":  # judged for the GPUs planned for, not this machine's CPU build of Paddle
            loaded = load_config(str(config), set_ or [], mode="validate", has_gpu=True)
        workload = Workload.from_config(cfg)
        layout = Layout.from_config(cfg)
        current = estimate_layout(workload, layout, dev)
        per_node = gpus if gpus is not None else max(1, world // nodes)
        if not do_search and per_node * nodes != world:
            p = cfg.parallel
            raise UserError(
                f"--gpus {per_node} x --nodes {nodes} = {per_node * nodes} devices, but the config's layout "
                f"needs {world} (data {p.data_parallel} x tensor {p.tensor_parallel} x pipeline "
                f"{p.pipeline_parallel} x sharding {p.sharding_parallel}); give --gpus x --nodes = {world}, or "
                f"add --search for the best layout on {per_node * nodes} devices"
            )
        longest = longest_sequence(workload, layout, dev)
        result = {
            "config": str(config),
            "device": dev.name,
            "estimate": current.to_dict(),
            "longest_seq_len": longest,
        }
        lines = current.lines()
        lines.append(
            f"longest sequence this layout fits: {longest} tokens (the planned rows: {workload.seq_len})"
        )
        if do_search:
            from bmtrain_cli.config.layout_admission import layout_admission

            admits = layout_admission(loaded.config, has_gpu=dev.kind == "gpu")
            found = search(workload, dev, per_node, nodes, top=top, admits=admits)
            found_dict: Dict[str, Any] = {
                "gpus": per_node,
                "nodes": nodes,
                "tried": found["tried"],
                "fitting": found["fitting"],
                "ranked": [c.to_dict() for c in found["ranked"]],
                "best_yaml": yaml_block(found["best"].layout) if found["best"] else None,
            }
            result["search"] = found_dict
            lines.append("")
            lines.append(
                f"search over {per_node * nodes} x {dev.name} ({nodes} node{'s' if nodes > 1 else ''}): "
                f"{found['fitting']} of {found['tried']} layouts fit; best first, by estimated step time with "
                "each extra setting\n(tensor or pipeline axis, sharding stage, offload, recompute) counted as "
                "1% slower, so a simpler layout ranks above a marginally faster one:"
            )
            for i, c in enumerate(found["ranked"], 1):
                lines.append(
                    f"  {i:>2}. {c.step_time_s:8.2f} s  peak {format_bytes(c.memory.peak):>11}  {c.layout.describe()}"
                )
            if found["best"] is None:
                lines.append(
                    "  nothing fits: use more devices, LoRA, a shorter max_seq_len or a smaller model"
                )
            else:
                b = found["best"]
                parts = ", ".join(f"{k} {v:.2f} s" for k, v in b.breakdown.items() if k != "total" and v > 0)
                best_longest = longest_sequence(workload, b.layout, dev)
                found_dict["best_longest_seq_len"] = best_longest
                lines += [
                    "",
                    f"best layout ({parts}; fits sequences up to {best_longest} tokens):",
                    yaml_block(b.layout),
                ]
        if as_json:
            typer.echo(json.dumps(result, indent=2))
            return
        for line in lines:
            typer.echo(line)
        for w in loaded.warnings:
            typer.echo("  " + w.format(), err=True)
