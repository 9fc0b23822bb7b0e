"""Shared pytest settings."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: needs the real embedded model (about a minute to prepare once)")
