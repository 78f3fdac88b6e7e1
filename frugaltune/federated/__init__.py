"""Federated fine-tuning on Flower: adapters + head trained where the data lives, only those tensors on the wire.

Library code. `aggregation` (pure torch: FedAvg, FFA-LoRA, rank padding) runs anywhere; `partition`,
`client_app` and `server_app` import Flower and run in the Flower environment `.venv-flower` (`make flower-env`:
flwr 1.32 needs protobuf<7, typer<0.21, rich<15, packaging<26 and flwr-datasets needs datasets<5, older than the
project's venv, so Flower gets a venv of its own that sees the project's packages behind its own).
"""
