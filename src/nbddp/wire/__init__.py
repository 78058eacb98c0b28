"""The wire, shared by every process: the messages and events, their bytes, authenticated
connections (handshake, frames, TLS, the listener), the streams' end markers, private
files, and payloads (objects to bytes, big tensors as files). It imports nothing else of
nbddp."""
