//! The few msgpack encodings a vLLM KV event batch needs (the fake engine publishes them).

/// An array header of `n` elements.
pub fn array(out: &mut Vec<u8>, n: usize) {
    match n {
        0..=15 => out.push(0x90 | n as u8),
        16..=0xffff => {
            out.push(0xdc);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        _ => {
            out.push(0xdd);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }
}

/// An unsigned integer in its smallest form (as msgspec writes it).
pub fn uint(out: &mut Vec<u8>, v: u64) {
    match v {
        0..=0x7f => out.push(v as u8),
        0x80..=0xff => out.extend_from_slice(&[0xcc, v as u8]),
        0x100..=0xffff => {
            out.push(0xcd);
            out.extend_from_slice(&(v as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            out.push(0xce);
            out.extend_from_slice(&(v as u32).to_be_bytes());
        }
        _ => {
            out.push(0xcf);
            out.extend_from_slice(&v.to_be_bytes());
        }
    }
}

pub fn nil(out: &mut Vec<u8>) {
    out.push(0xc0);
}

/// A float64 (msgspec writes every float so).
pub fn float(out: &mut Vec<u8>, v: f64) {
    out.push(0xcb);
    out.extend_from_slice(&v.to_bits().to_be_bytes());
}

/// A UTF-8 string (shorter than 64 KiB).
pub fn str(out: &mut Vec<u8>, s: &str) {
    match s.len() {
        0..=31 => out.push(0xa0 | s.len() as u8),
        32..=0xff => out.extend_from_slice(&[0xd9, s.len() as u8]),
        _ => {
            out.push(0xda);
            out.extend_from_slice(&(s.len() as u16).to_be_bytes());
        }
    }
    out.extend_from_slice(s.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_take_their_smallest_form() {
        let mut out = Vec::new();
        array(&mut out, 3);
        uint(&mut out, 5);
        uint(&mut out, 300);
        uint(&mut out, u64::MAX);
        nil(&mut out);
        str(&mut out, "GPU");
        float(&mut out, 1.5);
        assert_eq!(
            out,
            [
                &[0x93, 0x05, 0xcd, 0x01, 0x2c, 0xcf][..],
                &[0xff; 8],
                &[0xc0, 0xa3, b'G', b'P', b'U', 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0],
            ]
            .concat()
        );
    }
}
