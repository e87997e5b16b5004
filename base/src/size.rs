//! Parsing of human sizes such as `4k`, `512M` or `1GiB`, shared by the command-line tools.

pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(split);
    let n: u64 = digits.parse().map_err(|_| format!("'{text}' is not a size (examples: 4096, 4k, 512M, 8G)"))?;
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(format!("'{text}': unknown size suffix '{suffix}' (use k, M, G or T)")),
    };
    n.checked_mul(1u64 << shift).ok_or_else(|| format!("'{text}' overflows 64 bits"))
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("8GiB"), Ok(8 << 30));
        assert!(parse_size("12q").is_err());
        assert!(parse_size("k").is_err());
        assert!(parse_size("99999999999T").is_err());
    }
}
