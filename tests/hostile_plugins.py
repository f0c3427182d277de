"""Plugins that tests/test_hostile_input.py names by class path in command-line runs."""

from __future__ import annotations

from rlhf_lightning_plugins.rollout_engines import HFGenerate


class RenamedHF(HFGenerate):
    """``hf`` under another name: a rollout engine of another kind, for a resume that changes the engine."""
