"""PEFT adapters for the tiny test model, made by PEFT itself (random, non-zero lora_B)."""

from __future__ import annotations

from pathlib import Path

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base_dir: Path, out_dir: Path, *, r: int, seed: int,
                 targets: tuple[str, ...] = ALL_MODULES, use_rslora: bool = False,
                 lora_alpha: int | None = None, b_std: float = 0.05) -> str:
    """``b_std``: lora_B's spread (0.05 changes the tiny model's greedy tokens; SmolLM2 needs
    more, 0.3)."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=2 * r if lora_alpha is None else lora_alpha,
                        target_modules=list(targets), init_lora_weights=False,
                        use_rslora=use_rslora)
    model = get_peft_model(base, config)
    with torch.no_grad():  # PEFT's non-zero init is tiny: make each adapter change the output
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, b_std)
    model.save_pretrained(out_dir)
    return str(out_dir)
