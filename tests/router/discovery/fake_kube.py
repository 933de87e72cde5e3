"""The fake Kubernetes API server lives in ``bench/fake_kube.py`` (the discovery benchmark drives the router
against it too); these names stay importable from here for the tests that import them from this module."""

from bench.fake_kube import TOKEN, FakeKubeAPI, matches, pod

__all__ = ["TOKEN", "FakeKubeAPI", "matches", "pod"]
