//! The two frame ciphers: ChaCha20-Poly1305 (RFC 8439) and SM4-GCM (RFC 8998), behind
//! one type so the bus and the transfer engine seal alike whichever the cluster picked.
//!
//! ChaCha20-Poly1305 is ring's (assembly): RustCrypto's AVX2 backends cost about 2 µs on a
//! 150-byte bus frame here, mostly setting up per message, ten times ring's. SM4-GCM is
//! RustCrypto's GCM over its SM4 block cipher (ring has no SM4).

use aes_gcm::aead::consts::U12;
use aes_gcm::aead::{AeadInPlace, KeyInit};
use ring::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, Nonce, Tag, UnboundKey};

/// Bytes of every tag, both ciphers.
pub const TAG_BYTES: usize = 16;
/// Bytes of key material each key is made from (SM4 uses the first 16).
pub const KEY_BYTES: usize = 32;

type Sm4Gcm = aes_gcm::AesGcm<sm4::Sm4, U12>;

pub use tessera_vocab::Cipher;

/// A tag did not verify: the bytes, the associated data or the key are not the sealer's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("authentication failed")]
pub struct Unauthentic;

/// One key, its schedule computed once.
pub enum AeadKey {
    ChaCha(Box<LessSafeKey>),
    Sm4(Box<Sm4Gcm>),
}

impl std::fmt::Debug for AeadKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key itself.
        f.write_str(match self {
            AeadKey::ChaCha(_) => "AeadKey(chacha20-poly1305)",
            AeadKey::Sm4(_) => "AeadKey(sm4-gcm)",
        })
    }
}

impl AeadKey {
    pub fn new(cipher: Cipher, material: &[u8; KEY_BYTES]) -> AeadKey {
        match cipher {
            Cipher::ChaCha20Poly1305 => {
                // A 32-byte key is exactly what the algorithm takes, so this cannot fail.
                let key = UnboundKey::new(&CHACHA20_POLY1305, material).unwrap_or_else(|_| unreachable!());
                AeadKey::ChaCha(Box::new(LessSafeKey::new(key)))
            }
            Cipher::Sm4Gcm => {
                let key: [u8; 16] = std::array::from_fn(|i| material[i]);
                AeadKey::Sm4(Box::new(Sm4Gcm::new(&key.into())))
            }
        }
    }

    /// Encrypts `buf` in place and returns its tag.
    pub fn seal_in_place(&self, nonce: &[u8; 12], aad: &[u8], buf: &mut [u8]) -> [u8; TAG_BYTES] {
        // Both ciphers fail only on inputs of more than 2^36 bytes, far past any frame.
        match self {
            AeadKey::ChaCha(k) => k
                .seal_in_place_separate_tag(Nonce::assume_unique_for_key(*nonce), Aad::from(aad), buf)
                .map(|tag| tag.as_ref().try_into().unwrap_or([0; TAG_BYTES]))
                .unwrap_or([0; TAG_BYTES]),
            AeadKey::Sm4(k) => {
                k.encrypt_in_place_detached(nonce.into(), aad, buf).map(Into::into).unwrap_or([0; TAG_BYTES])
            }
        }
    }

    /// Checks `tag` and decrypts `buf` in place; on failure `buf` is left unspecified.
    pub fn open_in_place(
        &self,
        nonce: &[u8; 12],
        aad: &[u8],
        buf: &mut [u8],
        tag: &[u8; TAG_BYTES],
    ) -> Result<(), Unauthentic> {
        match self {
            AeadKey::ChaCha(k) => k
                .open_in_place_separate_tag(
                    Nonce::assume_unique_for_key(*nonce),
                    Aad::from(aad),
                    Tag::from(*tag),
                    buf,
                    0..,
                )
                .map(|_| ())
                .map_err(|_| Unauthentic),
            AeadKey::Sm4(k) => k.decrypt_in_place_detached(nonce.into(), aad, buf, tag.into()).map_err(|_| Unauthentic),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unhex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        tessera_access::unhex(&s).expect("hex")
    }

    fn check_vector(key: AeadKey, nonce: &str, aad: &str, plain: &str, cipher: &str, tag: &str) {
        let nonce: [u8; 12] = unhex(nonce).try_into().expect("12-byte nonce");
        let (aad, plain, expected) = (unhex(aad), unhex(plain), unhex(cipher));
        let mut buf = plain.clone();
        let got_tag = key.seal_in_place(&nonce, &aad, &mut buf);
        assert_eq!(buf, expected, "ciphertext");
        assert_eq!(got_tag.to_vec(), unhex(tag), "tag");
        let tag: [u8; TAG_BYTES] = got_tag;
        key.open_in_place(&nonce, &aad, &mut buf, &tag).expect("opens");
        assert_eq!(buf, plain);
        // One flipped bit anywhere (text, tag, associated data) and nothing opens.
        let mut text = expected.clone();
        text[0] ^= 1;
        assert_eq!(key.open_in_place(&nonce, &aad, &mut text, &tag), Err(Unauthentic));
        let mut bad_tag = tag;
        bad_tag[15] ^= 0x80;
        assert_eq!(key.open_in_place(&nonce, &aad, &mut expected.clone(), &bad_tag), Err(Unauthentic));
        let mut bad_aad = aad.clone();
        bad_aad.push(0);
        assert_eq!(key.open_in_place(&nonce, &bad_aad, &mut expected.clone(), &tag), Err(Unauthentic));
    }

    #[test]
    fn sm4_gcm_matches_rfc_8998_appendix_a1() {
        let mut material = [0u8; KEY_BYTES];
        material[..16].copy_from_slice(&unhex("0123456789ABCDEFFEDCBA9876543210"));
        check_vector(
            AeadKey::new(Cipher::Sm4Gcm, &material),
            "00001234567800000000ABCD",
            "FEEDFACEDEADBEEFFEEDFACEDEADBEEFABADDAD2",
            "AAAAAAAAAAAAAAAABBBBBBBBBBBBBBBBCCCCCCCCCCCCCCCCDDDDDDDDDDDDDDDD
             EEEEEEEEEEEEEEEEFFFFFFFFFFFFFFFFEEEEEEEEEEEEEEEEAAAAAAAAAAAAAAAA",
            "17F399F08C67D5EE19D0DC9969C4BB7D5FD46FD3756489069157B282BB200735
             D82710CA5C22F0CCFA7CBF93D496AC15A56834CBCF98C397B4024A2691233B8D",
            "83DE3541E4C2B58177E065A9BF7B62EC",
        );
    }

    #[test]
    fn chacha20_poly1305_matches_rfc_8439_section_2_8_2() {
        let material: [u8; KEY_BYTES] =
            unhex("808182838485868788898a8b8c8d8e8f909192939495969798999a9b9c9d9e9f").try_into().expect("key");
        let plain = "Ladies and Gentlemen of the class of '99: If I could offer you only one tip for the \
                     future, sunscreen would be it.";
        check_vector(
            AeadKey::new(Cipher::ChaCha20Poly1305, &material),
            "070000004041424344454647",
            "50515253c0c1c2c3c4c5c6c7",
            &tessera_access::hex(plain.as_bytes()),
            "d31a8d34648e60db7b86afbc53ef7ec2a4aded51296e08fea9e2b5a736ee62d63dbea45e8ca9671282fafb69da92728b
             1a71de0a9e060b2905d6a5b67ecd3b3692ddbd7f2d778b8c9803aee328091b58fab324e4fad675945585808b4831d7bc
             3ff4def08e4b7a9de576d26586cec64b6116",
            "1ae10b594f09e26a7e902ecbd0600691",
        );
    }
}
