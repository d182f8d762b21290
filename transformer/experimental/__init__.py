"""Paths no GPU has timed yet, kept in one place: float8 matrix products (`fp8`), the largest micro-batch
memory allows (`microbatch`, trainer.micro_batch=fit), per-layer torch.compile and the compile-cache report
(`regional_compile`), and attention over the real tokens only (`varlen`, `packed`: trainer.unpadded_attention).
Each is named experimental in `transformer-train --help` and in docs/performance.md, with the measurement that
would promote it; no recipe turns one on. The modules sit on the layer their users need (varlen under the
model, packed beside the data pipeline, the rest beside the trainer) and import nothing above it."""


def in_use(tcfg) -> list:
    """The experimental switches a trainer config turns on, as `key=value` strings (none by default)."""
    used = {"trainer.precision=fp8": tcfg.precision == "fp8", "trainer.micro_batch=fit": tcfg.micro_batch == "fit",
            "trainer.compile_scope=layers": tcfg.compile and tcfg.compile_scope == "layers",
            "trainer.unpadded_attention=true": tcfg.unpadded_attention}
    return [key for key, on in used.items() if on]
