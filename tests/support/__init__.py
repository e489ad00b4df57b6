"""What the tests share across layers: the fake backend (fake_backend.py) the GUI's tests run on."""
