"""The tiny task: what the tests, the bench and the CPU demo train on, made locally (no download).

    models.py     small causal LMs from configs (13 families, dense and MoE), random weights
    task.py       `hilore-verl tiny-task`: the CPU recipes' model, tokenizer, parquet data and reward
    workload.py   synthetic GRPO mini-batches in verl's data layout

Imports torch, transformers, tokenizers and pandas only; nothing in the product's training path imports it.
"""
