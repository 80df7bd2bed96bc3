"""Model side of JoyNexus: shared frozen backbones (Qwen3-VL, PaliGemma), tenant preprocessors, action-module
families (OFT, GR00T, π) and the framework that group-batches tenants' requests through one backbone forward."""
