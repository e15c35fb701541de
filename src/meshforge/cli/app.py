"""The typer application that every command module registers on."""

import typer

app = typer.Typer(
    name="meshforge",
    help="Distributed deep-learning training on PyTorch: train, plan, cost, sample.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
data_app = typer.Typer(
    help="Token shards: prepare them from text, JSONL, Parquet or datasets; inspect them.",
    no_args_is_help=True,
)
app.add_typer(data_app, name="data")
