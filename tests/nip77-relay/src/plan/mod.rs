//! The plan file `sdk-pool` and `bare-copy` read (included by both with `#[path]`): one JSON
//! object per line, `{"relays": ["ws://…", …], "filter": {…}}`; blank lines are skipped.

/// One line of a plan: its relays and its filter as JSON text.
pub struct Line {
    pub relays: Vec<String>,
    pub filter: String,
}

/// Every line of the plan at `path`; an error names the file and line.
pub fn read(path: &str) -> Result<Vec<Line>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    let mut plan = Vec::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let bad = |what: &str| format!("{path}:{}: {what}", n + 1);
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| bad(&e.to_string()))?;
        let relays = v["relays"]
            .as_array()
            .ok_or_else(|| bad("no \"relays\" list"))?
            .iter()
            .map(|r| {
                r.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| bad("a relay is not a string"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if !v["filter"].is_object() {
            return Err(bad("no \"filter\" object"));
        }
        plan.push(Line {
            relays,
            filter: v["filter"].to_string(),
        });
    }
    Ok(plan)
}
