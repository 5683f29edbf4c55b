import os
import sys

# The float64 NumPy references live beside the tests.
sys.path.insert(0, os.path.dirname(__file__))
