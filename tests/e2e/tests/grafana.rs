//! The Grafana dashboard (`deploy/grafana/kvaffine.json`) against a live stack: every
//! panel's expression parses as PromQL, and every metric it names is one that kvaffined's
//! `/metrics` or Envoy's `/stats/prometheus` (the filter's stats) exports while running.

use std::collections::BTreeSet;

use kvaffine_e2e::client::{post_json, send};
use kvaffine_e2e::{Stack, StackConfig, root};
use promql_parser::parser::{self, Expr};
use serde_json::{Value, json};

/// Every metric name a Prometheus text exposition declares or samples (a counter's
/// `_total`, a histogram's `_bucket`, `_sum` and `_count` included, as Prometheus stores them).
fn exported(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if let Some(declared) = line.strip_prefix("# TYPE ") {
            let mut parts = declared.split_whitespace();
            let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
                continue;
            };
            let suffixes: &[&str] = match kind {
                "counter" => &["", "_total"],
                "histogram" => &["_bucket", "_sum", "_count"],
                _ => &[""],
            };
            names.extend(suffixes.iter().map(|s| format!("{name}{s}")));
        } else if !line.starts_with('#') {
            if let Some(name) = line.split(['{', ' ']).next().filter(|n| !n.is_empty()) {
                names.insert(name.to_owned());
            }
        }
    }
    names
}

/// The metric names an expression selects.
fn selected(expr: &Expr, names: &mut Vec<String>) {
    match expr {
        Expr::Aggregate(a) => {
            selected(&a.expr, names);
            if let Some(param) = &a.param {
                selected(param, names);
            }
        }
        Expr::Unary(u) => selected(&u.expr, names),
        Expr::Binary(b) => {
            selected(&b.lhs, names);
            selected(&b.rhs, names);
        }
        Expr::Paren(p) => selected(&p.expr, names),
        Expr::Subquery(s) => selected(&s.expr, names),
        Expr::VectorSelector(v) => names.extend(v.name.clone()),
        Expr::MatrixSelector(m) => names.extend(m.vs.name.clone()),
        Expr::Call(c) => c.args.args.iter().for_each(|arg| selected(arg, names)),
        Expr::NumberLiteral(_) | Expr::StringLiteral(_) | Expr::Extension(_) => {}
    }
}

#[test]
fn every_dashboard_panel_parses_and_names_a_live_metric() {
    let stack = Stack::start(StackConfig::default()).unwrap();
    // Traffic, so that every per-replica series exists: a conversation, its outcomes and
    // the replicas' scraped hits.
    stack.wait_scraped().unwrap();
    let text: String = (0..400)
        .map(|i| format!("w{} ", (i * 7919) % 4999))
        .collect();
    let mut body = json!({"messages": [{"role": "user", "content": text}], "max_tokens": 2});
    let first = post_json(&stack.gateway, "/v1/chat/completions", &body);
    assert_eq!(first.status, 200);
    let messages = body["messages"].as_array_mut().unwrap();
    messages.push(first.json()["choices"][0]["message"].clone());
    messages.push(json!({"role": "user", "content": "more"}));
    assert_eq!(
        post_json(&stack.gateway, "/v1/chat/completions", &body).status,
        200
    );
    stack.wait_outcomes(2).unwrap();

    let mut live = exported(&send(&stack.daemon_addr, "GET", "/metrics", &[], b"").body);
    live.extend(exported(
        &send(&stack.admin, "GET", "/stats/prometheus", &[], b"").body,
    ));
    assert!(live.contains("kvaffined_lookups_total") && live.contains("kvaffine_requests"));

    let path = root().join("deploy/grafana/kvaffine.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut checked = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        let title = panel["title"].as_str().unwrap_or_default();
        let Some(targets) = panel["targets"].as_array() else {
            assert_eq!(panel["type"], "row", "{title}: a panel without queries");
            continue;
        };
        assert!(!targets.is_empty(), "{title}: no queries");
        for target in targets {
            let expr = target["expr"].as_str().expect("a PromQL expression");
            // Grafana fills its interval variable in before Prometheus sees the query.
            let query = expr.replace("$__rate_interval", "5m");
            let ast = parser::parse(&query)
                .unwrap_or_else(|e| panic!("{title}: {expr:?} is not PromQL: {e}"));
            let mut names = Vec::new();
            selected(&ast, &mut names);
            assert!(!names.is_empty(), "{title}: {expr:?} names no metric");
            for name in names {
                assert!(
                    live.contains(&name),
                    "{title}: {name} is not exported by a running stack"
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 30, "only {checked} metric references");
}
