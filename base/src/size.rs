//! Parsing of human sizes such as `4k`, `512M` or `1GiB`, shared by the command-line tools.

/// Why a size did not parse; each names the text it was given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("'{0}' is not a size (examples: 4096, 4k, 512M, 8G)")]
    NotANumber(String),
    #[error("'{text}': unknown size suffix '{suffix}' (use k, M, G or T)")]
    UnknownSuffix { text: String, suffix: String },
    #[error("'{0}' overflows 64 bits")]
    Overflow(String),
}

pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(split);
    let n: u64 = digits.parse().map_err(|_| SizeError::NotANumber(text.to_owned()))?;
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(SizeError::UnknownSuffix { text: text.to_owned(), suffix: suffix.to_owned() }),
    };
    n.checked_mul(1u64 << shift).ok_or_else(|| SizeError::Overflow(text.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::{parse_size, SizeError};

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("8GiB"), Ok(8 << 30));
        assert_eq!(parse_size("12q"), Err(SizeError::UnknownSuffix { text: "12q".into(), suffix: "q".into() }));
        assert_eq!(parse_size("k"), Err(SizeError::NotANumber("k".into())));
        assert_eq!(parse_size("99999999999T"), Err(SizeError::Overflow("99999999999T".into())));
        assert_eq!(parse_size("2x").unwrap_err().to_string(), "'2x': unknown size suffix 'x' (use k, M, G or T)");
    }
}
