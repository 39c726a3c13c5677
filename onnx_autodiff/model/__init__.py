"""A model whose tensors live outside protobuf: the weights store, reading and writing files atomically, the
metadata keys of the file format, and the one door every public entry takes a model through."""
