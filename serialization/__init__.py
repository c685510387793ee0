from serialization.codec import msgpack_numpy_decoder, msgpack_numpy_encoder

__all__ = ["msgpack_numpy_decoder", "msgpack_numpy_encoder"]
