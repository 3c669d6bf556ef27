"""The hybrid engine: fast, exact generation for a ZeRO-3 (or ZeRO-0/1/2) actor.

``HybridEngine(actor_engine, settings)`` (``settings``: the hybrid engine's block,
:class:`chatrl.config.HybridEngineConfig`) wraps the actor's DeepSpeed engine; ``generate`` takes
left-padded token ids and returns token ids. See ``docs/hybrid_engine.md``.
"""

from chatrl.hybrid_engine.decode import GenerationSettings
from chatrl.hybrid_engine.engine import HybridEngine, HybridEngineFallbackWarning, Sampler
from chatrl.hybrid_engine.tp_plan import SUPPORTED_FAMILIES

__all__ = ["GenerationSettings", "HybridEngine", "HybridEngineFallbackWarning", "SUPPORTED_FAMILIES",
           "Sampler"]
