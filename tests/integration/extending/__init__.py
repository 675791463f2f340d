"""User code of docs/extending.md's three examples, one module each (the doc shows these files
as they are; tests/unit/test_extending_examples.py checks it), and the tests' glue."""
