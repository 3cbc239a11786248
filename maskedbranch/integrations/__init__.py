"""Integrations of maskedbranch with other libraries and torch features.

* :mod:`maskedbranch.integrations.timm` - ``patch(model)`` converts the drop-path residuals of a
  timm model (any family: a generic torch.fx rewrite) so that stochastic depth skips the dropped
  samples' compute.
  Needs timm (``pip install "maskedbranch[timm]"``); importing this package does not import it.
* :mod:`maskedbranch.integrations.torchvision` - ``patch(model)`` converts the residual blocks of
  every torchvision model with stochastic depth (ConvNeXt, Swin / Swin V2 / Swin3D, EfficientNet /
  EfficientNet V2, MaxViT, MViT: one routed forward per block class) so that ``StochasticDepth``
  skips the dropped samples' compute, with torchvision's draws. Needs torchvision.
* :mod:`maskedbranch.integrations.transformers` - ``patch(model)`` makes the LayerDrop of a Hugging
  Face transformers model (the Wav2Vec2 family, BART / Whisper / Marian / ... encoders and
  decoders, and more: ``SUPPORTED``) skip the dropped layers' compute and train under DDP with
  ``find_unused_parameters=False``, with HF's own random draws. Needs transformers.
* :mod:`maskedbranch.integrations.checkpoint` - ``replay_generators(...)``: a ``context_fn`` for
  ``torch.utils.checkpoint.checkpoint`` that replays the drop masks drawn from user-provided
  ``torch.Generator`` objects during the recomputation.
"""

# The submodules are imported explicitly (``from maskedbranch.integrations import timm``): timm,
# torchvision and transformers are optional, so nothing is imported here.
__all__: list = []
