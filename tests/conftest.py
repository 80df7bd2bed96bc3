# --- tiny_backbone (nexus.model tests): one tiny offline Qwen3-VL per test session -----------------
import pytest
import torch


@pytest.fixture(scope="session")
def tiny_backbone():
    """The offline tiny SharedBackbone (random weights, fixed seed), built once per session (~2 s)."""
    from nexus.model.backbone import BackboneConfig, SharedBackbone

    torch.set_num_threads(1)
    return SharedBackbone(BackboneConfig(size="tiny", image_size=64))
# --- end tiny_backbone ------------------------------------------------------------------------------
