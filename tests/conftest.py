# --- tiny_backbone (nexus.model tests): one tiny offline backbone per family per test session -------
import pytest
import torch


@pytest.fixture(scope="session")
def tiny_backbone():
    """The offline tiny Qwen3-VL SharedBackbone (random weights, fixed seed), built once per session (~2 s)."""
    from nexus.model.backbone import BackboneConfig, SharedBackbone

    torch.set_num_threads(1)
    return SharedBackbone(BackboneConfig(size="tiny", image_size=64))


@pytest.fixture(scope="session")
def tiny_paligemma():
    """The offline tiny PaliGemma SharedBackbone (OpenPI's backbone family), built once per session."""
    from nexus.model.backbone import BackboneConfig, SharedBackbone

    torch.set_num_threads(1)
    return SharedBackbone(BackboneConfig(family="paligemma", size="tiny", image_size=64))
# --- end tiny_backbone ------------------------------------------------------------------------------
