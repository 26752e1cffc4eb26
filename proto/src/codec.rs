//! The protobuf codec of the API, with buffers sized for its messages.
//!
//! tonic's default codec gives every call an 8 KiB encode and an 8 KiB decode buffer
//! up front. An `Acquire` stream lives as long as its lease and its messages are tens
//! of bytes, so a server holding 100 000 leases would spend 1.6 GiB on buffers that
//! are never filled. These start small and grow only if a message needs it.
//!
//! A message that does not decode is answered INVALID_ARGUMENT naming the field, as
//! every other bad field is, where prost's codec answers INTERNAL.

use std::marker::PhantomData;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::Status;
use tonic_prost::{ProstCodec, ProstEncoder};
use tonic_types::{ErrorDetails, StatusExt};

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
    type Decoder = LeanDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(settings())
    }

    fn decoder(&mut self) -> Self::Decoder {
        LeanDecoder(PhantomData)
    }
}

fn settings() -> BufferSettings {
    BufferSettings::new(BUFFER_SIZE, YIELD_THRESHOLD)
}

/// Decodes `U` with [`BUFFER_SIZE`] buffers; a message that does not decode (a string
/// that is not UTF-8, a wrong wire type) is INVALID_ARGUMENT naming the field. (prost's
/// codec answers INTERNAL, which an Acquire stream could not tell from a client gone.)
#[derive(Debug)]
pub struct LeanDecoder<U>(PhantomData<U>);

impl<U: prost::Message + Default> Decoder for LeanDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        U::decode(buf).map(Some).map_err(|e| undecodable(&e.to_string()))
    }

    fn buffer_settings(&self) -> BufferSettings {
        settings()
    }
}

/// The status of a message that does not decode, from prost's error text
/// (`failed to decode Protobuf message: Open.name: AcquireRequest.action: <what>`: the
/// fields innermost first): the field as the API names it, the request's own field
/// or, one level down, `open.name`. The ErrorInfo is the server's (domain `latchkey`).
fn undecodable(error: &str) -> Status {
    let rest = error
        .strip_prefix("failed to decode Protobuf message: ")
        .unwrap_or(error);
    let mut path: Vec<&str> = Vec::new();
    let mut what = rest;
    while let Some((segment, tail)) = what.split_once(": ") {
        if !is_field(segment) {
            break;
        }
        path.push(segment);
        what = tail;
    }
    let field = match path.as_slice() {
        [] => "message".to_owned(),
        [.., inner, _] => {
            let (message, field) = inner.split_once('.').unwrap_or_default();
            format!("{}.{field}", snake(message))
        }
        [only] => only.split_once('.').map_or("", |(_, f)| f).to_owned(),
    };
    let info = ErrorDetails::with_error_info("INVALID_ARGUMENT", "latchkey", [("field".to_owned(), field.clone())]);
    Status::with_error_details(
        tonic::Code::InvalidArgument,
        format!("{field}: does not decode: {what}"),
        info,
    )
}

/// Whether prost's error text names a field here: `Message.field`.
fn is_field(segment: &str) -> bool {
    segment.split_once('.').is_some_and(|(m, f)| {
        m.starts_with(|c: char| c.is_ascii_uppercase())
            && m.chars().all(|c| c.is_ascii_alphanumeric())
            && !f.is_empty()
            && f.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    })
}

/// `WaitTimeout` → `wait_timeout`.
fn snake(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 4);
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::undecodable;

    fn field_and_message(error: &str) -> (String, String) {
        let s = undecodable(error);
        assert_eq!(s.code(), tonic::Code::InvalidArgument);
        let info = tonic_types::StatusExt::get_details_error_info(&s).unwrap();
        (info.metadata["field"].clone(), s.message().to_owned())
    }

    #[test]
    fn the_field_is_named_as_the_api_names_it() {
        let prefix = "failed to decode Protobuf message: ";
        let (f, m) = field_and_message(&format!(
            "{prefix}DescribeRequest.name: invalid string value: data is not UTF-8 encoded"
        ));
        assert_eq!(f, "name");
        assert_eq!(
            m,
            "name: does not decode: invalid string value: data is not UTF-8 encoded"
        );
        let (f, _) = field_and_message(&format!(
            "{prefix}Open.name: AcquireRequest.action: invalid string value"
        ));
        assert_eq!(f, "open.name");
        let deep = format!("{prefix}Duration.seconds: Open.wait_timeout: AcquireRequest.action: invalid varint");
        assert_eq!(field_and_message(&deep).0, "open.wait_timeout");
        assert_eq!(field_and_message(&format!("{prefix}buffer underflow")).0, "message");
    }
}
