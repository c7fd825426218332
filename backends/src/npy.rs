//! Writes little-endian float32 `.npy` files (NumPy format 1.0), e.g. the logits a
//! generation sampled from.

use std::io::Write;
use std::path::Path;

use crate::error::{BackendError, Result};

/// Writes `data` as a float32 array of `shape` to `path`.
pub fn write_f32(path: &Path, shape: &[usize], data: &[f32]) -> Result<()> {
    let count: usize = shape.iter().product();
    if count != data.len() {
        return Err(BackendError::Request(format!("npy shape {shape:?} holds {count} values, got {}", data.len())));
    }
    let dims = match shape {
        [d] => format!("({d},)"),
        _ => format!("({})", shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")),
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {dims}, }}");
    // Magic (6) + version (2) + length (2) + header + '\n' is padded to 64 bytes.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + data.len() * 4);
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for v in data {
        out.extend_from_slice(&v.to_le_bytes());
    }
    let mut file = std::fs::File::create(path).map_err(|e| BackendError::io(path, e))?;
    file.write_all(&out).map_err(|e| BackendError::io(path, e))
}

#[cfg(test)]
mod tests {
    #[test]
    fn header_is_aligned_and_data_follows() {
        let dir = std::env::temp_dir().join(format!("tessera-npy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.npy");
        super::write_f32(&path, &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
        assert_eq!((10 + hlen) % 64, 0);
        let header = std::str::from_utf8(&bytes[10..10 + hlen]).unwrap();
        assert!(header.contains("'shape': (2, 3)"), "{header}");
        assert_eq!(&bytes[10 + hlen..10 + hlen + 4], &1.0f32.to_le_bytes());
        assert_eq!(bytes.len(), 10 + hlen + 24);
        assert!(super::write_f32(&path, &[4], &[1.0]).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
