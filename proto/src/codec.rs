//! The protobuf codec of the API, with buffers sized for its messages.
//!
//! tonic's default codec gives every call an 8 KiB encode and an 8 KiB decode buffer
//! up front. An `Acquire` stream lives as long as its lease and its messages are tens
//! of bytes, so a server holding 100 000 leases would spend 1.6 GiB on buffers that
//! are never filled. These start small and grow only if a message needs it.

use std::marker::PhantomData;
use tonic::codec::{BufferSettings, Codec};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// Initial encode/decode buffer per call; larger messages grow it.
const BUFFER_SIZE: usize = 256;
/// tonic's default: how much encoded data is gathered before it is handed on.
const YIELD_THRESHOLD: usize = 32 * 1024;

/// [`ProstCodec`] with [`BUFFER_SIZE`] buffers.
#[derive(Debug, Clone, Copy)]
pub struct LeanCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for LeanCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for LeanCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(settings())
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<T, U>::raw_decoder(settings())
    }
}

fn settings() -> BufferSettings {
    BufferSettings::new(BUFFER_SIZE, YIELD_THRESHOLD)
}
