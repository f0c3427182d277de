"""Trainer settings shared by the scripted runs (the closed-form lab's training, the tools' runs)."""

# One CPU process with no logger, checkpoints, progress bar, model summary, sanity check or
# validation. Trainer(**QUIET_TRAINER, callbacks=...).
QUIET_TRAINER: dict = dict(
    accelerator="cpu",
    devices=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    limit_val_batches=0,
)
