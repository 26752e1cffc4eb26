//! Compiles `latchkey/v1/latchkey.proto` without a system `protoc`: protox builds
//! the descriptors, tonic-prost-build generates the code, and the descriptor set is
//! saved for server reflection.

use prost::Message;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let fds = protox::compile(["latchkey/v1/latchkey.proto"], ["."])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("latchkey_descriptor.bin"), fds.encode_to_vec())?;
    // Every message of this API is small: start its buffers small too (see `codec`).
    tonic_prost_build::configure()
        .codec_path("crate::codec::LeanCodec")
        .compile_fds(fds)?;
    println!("cargo:rerun-if-changed=latchkey");
    Ok(())
}
