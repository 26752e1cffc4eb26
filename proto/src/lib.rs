//! The `latchkey.v1` API (`proto/latchkey/v1/latchkey.proto`), generated once for
//! the server, the Rust client and the tests.

/// `latchkey.v1`: the `LockService` and its messages.
#[allow(missing_docs, clippy::all)]
pub mod v1 {
    tonic::include_proto!("latchkey.v1");
}

pub mod coalesce;
pub mod codec;

/// The encoded descriptor set of the API, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("latchkey_descriptor");
