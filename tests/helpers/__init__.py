"""Helpers shared by the test modules: configs and the CLI (`cli`), small corpora and a loopback HTTP
server (`data`), multi-process runs and checkpoint comparison (`dist`), reference decoders (`decoding`)."""
