"""The prefill service (`Prefill.Handoff`): what runs in a prefill pod."""
