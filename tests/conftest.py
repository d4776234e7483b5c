import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

def pytest_configure(config):
    config.addinivalue_line("markers", "multiprocess: launches real DeepSpeed processes (slow, tens of seconds)")
