//! Dynamo-compatible block hashing (XXH3-64, seed 1337), bit for bit.

use kvrouter_sys as sys;

use crate::error::{Error, Result};
use crate::raw::init;
use crate::util::{opt_cstring, opt_ptr, slice_ptr, Multimodal};

/// What changes a prompt's block hashes besides its tokens (`kvr_hash_options`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HashOptions<'a> {
    /// Eagle windows: block_size + 1 tokens, stride block_size.
    pub eagle: bool,
    /// None or "" = the base model.
    pub lora_name: Option<&'a str>,
    /// None or "" = none.
    pub cache_namespace: Option<&'a str>,
    pub multimodal: Option<Multimodal<'a>>,
}

/// The local hashes of every complete block of `tokens` (one token fewer per block count
/// with eagle). `InvalidArgument` for block size 0.
pub fn compute_block_hashes(
    tokens: &[u32],
    block_size: u32,
    options: &HashOptions<'_>,
) -> Result<Vec<u64>> {
    crate::check_version()?;
    if block_size == 0 {
        return Err(Error::invalid("block_size is 0"));
    }
    let lora = opt_cstring("lora_name", options.lora_name)?;
    let namespace = opt_cstring("cache_namespace", options.cache_namespace)?;
    let mut raw = init::<sys::kvr_hash_options>();
    if options.eagle {
        raw.flags |= sys::KVR_HASH_EAGLE;
    }
    raw.lora_name = opt_ptr(&lora);
    raw.cache_namespace = opt_ptr(&namespace);
    if let Some(mm) = &options.multimodal {
        mm.check("hash options", None)?;
        raw.mm_hashes = slice_ptr(mm.hashes);
        raw.mm_counts = slice_ptr(mm.counts);
        raw.mm_num_blocks = mm.counts.len();
    }
    let expected = tokens.len() / block_size as usize;
    crate::error::fill_vec(expected, |out, cap, len, err| {
        // SAFETY: tokens, raw and its strings live across the call; out has room for cap.
        unsafe {
            sys::kvr_compute_block_hashes(
                slice_ptr(tokens),
                tokens.len(),
                block_size,
                &raw,
                out,
                cap,
                len,
                err,
            )
        }
    })
}

/// The chained sequence hashes of local block hashes (one per input).
pub fn compute_sequence_hashes(local_hashes: &[u64]) -> Result<Vec<u64>> {
    crate::check_version()?;
    crate::error::fill_vec(local_hashes.len(), |out, cap, len, err| {
        // SAFETY: local_hashes lives across the call; out has room for cap.
        unsafe {
            sys::kvr_compute_sequence_hashes(
                slice_ptr(local_hashes),
                local_hashes.len(),
                out,
                cap,
                len,
                err,
            )
        }
    })
}
