"""The store and what writes and checks it: the format (store), checkpoint reading (source), low-bit
formats (quant), checkpoint -> store (convert), verification, byte arithmetic (sizes), synthetic models."""
