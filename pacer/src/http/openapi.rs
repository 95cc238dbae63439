//! `GET /v1/openapi.json`: the OpenAPI 3.1 document of the whole API,
//! hand-written in `pacer/openapi.json` and compiled into the binary. Its
//! tests keep it and the router in step: the same (method, path) pairs,
//! every reference resolving, served without a token.

use axum::http::header;
use axum::response::{IntoResponse, Response};

/// The document, as kept in the repository.
pub(crate) const DOCUMENT: &str = include_str!("../../openapi.json");

pub(crate) async fn document() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], DOCUMENT).into_response()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::sync::Arc;

    use adspend_wire::catalog::Catalog;
    use serde_json::Value;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    use tokio::sync::{watch, RwLock};

    use super::DOCUMENT;
    use crate::http::api::{self, AppState};
    use crate::http::auth::Auth;
    use crate::pacing::state::SpendState;

    const READ: &str = "read-token-0123456789abcdef";
    const DECIDE: &str = "decide-token-0123456789abcdef";
    const METHODS: [&str; 8] = [
        "get", "put", "post", "delete", "options", "head", "patch", "trace",
    ];

    fn document() -> Value {
        serde_json::from_str(DOCUMENT).expect("pacer/openapi.json is JSON")
    }

    /// Every (method, path) the router serves, from the tables it is
    /// built from.
    fn served() -> BTreeSet<(String, String)> {
        let mut routes = Vec::new();
        routes.extend(api::read_routes().map(|(m, p, _)| (m, p)));
        routes.extend(api::decide_routes().map(|(m, p, _)| (m, p)));
        routes.extend(api::open_routes().map(|(m, p, _)| (m, p)));
        routes.extend(api::ops_route_table::<AppState>().map(|(m, p, _)| (m, p)));
        routes
            .into_iter()
            .map(|(m, p)| (m.to_string(), p.to_string()))
            .collect()
    }

    fn documented(doc: &Value) -> BTreeSet<(String, String)> {
        let paths = doc["paths"].as_object().expect("paths is an object");
        let mut pairs = BTreeSet::new();
        for (path, item) in paths {
            for method in item.as_object().expect("a path item is an object").keys() {
                assert!(
                    METHODS.contains(&method.as_str()) || method == "parameters",
                    "{path}: {method:?} is not an operation"
                );
                if METHODS.contains(&method.as_str()) {
                    pairs.insert((method.clone(), path.clone()));
                }
            }
        }
        pairs
    }

    fn refs<'a>(value: &'a Value, out: &mut Vec<&'a str>) {
        match value {
            Value::Object(map) => {
                if let Some(Value::String(target)) = map.get("$ref") {
                    out.push(target);
                }
                map.values().for_each(|v| refs(v, out));
            }
            Value::Array(items) => items.iter().for_each(|v| refs(v, out)),
            _ => {}
        }
    }

    #[test]
    fn document_is_openapi_3_1() {
        let doc = document();
        let version = doc["openapi"].as_str().expect("openapi is a string");
        assert!(version.starts_with("3.1."), "openapi {version}");
        assert!(doc["info"]["title"].is_string() && doc["info"]["version"].is_string());
    }

    /// A client generated from the document groups its calls by tag: every
    /// operation has exactly one, and every tag is declared with a
    /// description.
    #[test]
    fn every_operation_has_one_declared_tag() {
        let doc = document();
        let declared: BTreeSet<&str> = doc["tags"]
            .as_array()
            .expect("top-level tags")
            .iter()
            .map(|t| {
                assert!(t["description"].is_string(), "tag without description: {t}");
                t["name"].as_str().expect("a tag has a name")
            })
            .collect();
        let mut used = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for (method, op) in item.as_object().expect("a path item") {
                let tags = op["tags"]
                    .as_array()
                    .unwrap_or_else(|| panic!("{method} {path}: no tags"));
                assert_eq!(tags.len(), 1, "{method} {path}: {tags:?}");
                let tag = tags[0].as_str().expect("a tag is a string");
                assert!(
                    declared.contains(tag),
                    "{method} {path}: undeclared tag {tag}"
                );
                used.insert(tag);
            }
        }
        assert_eq!(used, declared, "a declared tag that no operation uses");
    }

    #[test]
    fn document_and_router_have_the_same_routes() {
        let doc = document();
        let served = served();
        let documented = documented(&doc);
        assert!(served.len() >= 11, "route tables lost routes: {served:?}");
        assert_eq!(
            documented.difference(&served).collect::<Vec<_>>(),
            Vec::<&(String, String)>::new(),
            "in pacer/openapi.json but not served"
        );
        assert_eq!(
            served.difference(&documented).collect::<Vec<_>>(),
            Vec::<&(String, String)>::new(),
            "served but not in pacer/openapi.json"
        );
    }

    #[test]
    fn every_reference_resolves_and_every_response_has_a_schema() {
        let doc = document();
        let mut targets = Vec::new();
        refs(&doc, &mut targets);
        assert!(targets.len() > 20, "too few references: {targets:?}");
        for target in targets {
            let pointer = target
                .strip_prefix('#')
                .unwrap_or_else(|| panic!("{target}: not a local reference"));
            assert!(doc.pointer(pointer).is_some(), "{target} does not exist");
        }
        for (method, path) in documented(&doc) {
            let operation = &doc["paths"][&path][&method];
            let responses = operation["responses"]
                .as_object()
                .unwrap_or_else(|| panic!("{method} {path}: no responses"));
            assert!(responses.contains_key("200"), "{method} {path}: no 200");
            for (status, response) in responses {
                let response = match response["$ref"].as_str() {
                    Some(target) => doc.pointer(&target[1..]).unwrap(),
                    None => response,
                };
                let content = response["content"]
                    .as_object()
                    .unwrap_or_else(|| panic!("{method} {path} {status}: no content"));
                for (media, body) in content {
                    assert!(
                        body["schema"].is_object(),
                        "{method} {path} {status} {media}: no schema"
                    );
                }
                if status != "200" {
                    assert_eq!(
                        content["application/json"]["schema"]["$ref"], "#/components/schemas/Error",
                        "{method} {path} {status}: errors are JSON"
                    );
                }
            }
            assert!(
                operation["security"].is_array(),
                "{method} {path}: no security requirement"
            );
        }
        for scheme in ["readToken", "decideToken"] {
            let scheme = &doc["components"]["securitySchemes"][scheme];
            assert_eq!(scheme["type"], "http");
            assert_eq!(scheme["scheme"], "bearer");
        }
    }

    /// The API with both scopes' tokens required; keep the sender while serving.
    async fn start() -> (std::net::SocketAddr, watch::Sender<Arc<Catalog>>) {
        let catalog = Catalog::parse(
            "test",
            br#"{"limits": {"campaign": {"budget_micros": 5000, "period": "lifetime"}},
                 "ads": {"ad-1": ["campaign"]}}"#,
        )
        .unwrap();
        let (sender, receiver) = watch::channel(Arc::new(catalog));
        let state = AppState {
            catalog: receiver,
            spend: Arc::new(RwLock::new(SpendState::default())),
            sources: Default::default(),
            alerts: Default::default(),
            max_decision_ids: 1_000,
            leases: None,
            regions: None,
        };
        let auth = Auth::new(vec![READ.into()], vec![DECIDE.into()]);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            axum::serve(listener, api::router(state, auth))
                .await
                .unwrap();
        });
        (addr, sender)
    }

    /// (status, lower-cased head, body) of one request on its own connection.
    async fn request(
        addr: std::net::SocketAddr,
        method: &str,
        path: &str,
    ) -> (u16, String, String) {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let head = format!("{method} {path} HTTP/1.1\r\nhost: pacer\r\nconnection: close\r\n\r\n");
        stream.write_all(head.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.unwrap();
        let raw = String::from_utf8(raw).unwrap();
        let (head, body) = raw.split_once("\r\n\r\n").unwrap();
        let status = head[9..12].parse().unwrap();
        (status, head.to_ascii_lowercase(), body.to_string())
    }

    #[tokio::test]
    async fn served_as_json_without_a_token_while_tokens_are_required() {
        let (addr, _catalog) = start().await;
        let (status, head, body) = request(addr, "GET", "/v1/openapi.json").await;
        assert_eq!(status, 200, "{head}");
        assert!(head.contains("content-type: application/json"), "{head}");
        let served: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(served, document());
        // The tokens are in force: a read route refuses the same request.
        let (status, _, _) = request(addr, "GET", "/v1/limits").await;
        assert_eq!(status, 401);
    }

    #[tokio::test]
    async fn every_documented_route_answers_its_method() {
        let (addr, _catalog) = start().await;
        for (method, path) in documented(&document()) {
            let path = path.replace("{limit_id}", "campaign");
            let (status, head, body) = request(addr, &method.to_uppercase(), &path).await;
            assert!(
                status != 404 && status != 405,
                "{method} {path}: {status} {head} {body}"
            );
        }
    }
}
