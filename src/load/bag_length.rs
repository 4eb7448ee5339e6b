//! `--user-bag-ids` and `--history-len`: a bag's (or a history's) length,
//! fixed or drawn uniformly from a range.

/// `--user-bag-ids`: how many ids each request-level bag holds: `N`
/// (exactly N) or `MIN-MAX` (uniform in MIN..=MAX, drawn per user and
/// feature).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BagLength {
    /// Fewest ids.
    pub min: u32,
    /// Most ids.
    pub max: u32,
}

impl std::str::FromStr for BagLength {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let invalid = || format!("`{text}` is not a bag length: use `N` or `MIN-MAX` (MIN <= MAX)");
        let number = |s: &str| s.trim().parse::<u32>().map_err(|_| invalid());
        let (min, max) = match text.split_once('-') {
            None => (number(text)?, number(text)?),
            Some((min, max)) => (number(min)?, number(max)?),
        };
        if min > max {
            return Err(invalid());
        }
        Ok(Self { min, max })
    }
}

impl std::fmt::Display for BagLength {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.min == self.max {
            write!(f, "{}", self.min)
        } else {
            write!(f, "{}-{}", self.min, self.max)
        }
    }
}
