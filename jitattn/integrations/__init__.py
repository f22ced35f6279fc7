"""Integrations of jitattn's backends into model libraries (:mod:`jitattn.integrations.transformers`)."""
