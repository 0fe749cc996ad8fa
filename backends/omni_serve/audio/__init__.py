"""Audio generator (omni_audio): codec tokens -> waveform chunks."""
