//! The per-address connection cap: one host takes at most its share of
//! the API port's places.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex};

/// Open connections per client address. One host (an IPv6 client by its
/// /64, which one subscriber usually holds whole) counts as one address;
/// the table holds only addresses with a connection open, so it is never
/// larger than the connection cap.
pub(crate) struct PerAddr {
    max: usize,
    open: Mutex<HashMap<IpAddr, usize>>,
}

/// A connection's place under its address's cap, given back on drop.
pub(crate) struct AddrSlot {
    table: Arc<PerAddr>,
    key: IpAddr,
}

impl PerAddr {
    pub(super) fn new(max: usize) -> Self {
        PerAddr {
            max,
            open: Mutex::new(HashMap::new()),
        }
    }

    /// A place for a connection from `ip`, unless its address is at the cap.
    pub(super) fn take(table: &Arc<PerAddr>, ip: IpAddr) -> Option<AddrSlot> {
        let key = addr_key(ip);
        let mut open = table.open.lock().unwrap_or_else(|e| e.into_inner());
        let count = open.entry(key).or_insert(0);
        if *count >= table.max {
            return None;
        }
        *count += 1;
        Some(AddrSlot {
            table: table.clone(),
            key,
        })
    }

    /// Most connections one address may hold.
    pub(super) fn max(&self) -> usize {
        self.max
    }

    /// Connections open from `ip`'s address.
    #[cfg(test)]
    fn open(&self, ip: IpAddr) -> usize {
        let open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        open.get(&addr_key(ip)).copied().unwrap_or(0)
    }
}

impl Drop for AddrSlot {
    fn drop(&mut self) {
        let mut open = self.table.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = open.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.key);
            }
        }
    }
}

/// The address a client is counted under: IPv4 as is (an IPv4-mapped IPv6
/// address too), IPv6 by its /64.
fn addr_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & (u128::MAX << 64))),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_address_has_its_own_count_and_gets_its_places_back() {
        let table = Arc::new(PerAddr::new(2));
        let a: IpAddr = "127.0.0.1".parse().unwrap();
        let b: IpAddr = "127.0.0.2".parse().unwrap();
        let first = PerAddr::take(&table, a).expect("first of a");
        let second = PerAddr::take(&table, a).expect("second of a");
        assert!(PerAddr::take(&table, a).is_none(), "a is at its cap");
        assert!(PerAddr::take(&table, b).is_some(), "b is not");
        assert_eq!(table.open(a), 2);
        drop(first);
        assert_eq!(table.open(a), 1);
        let third = PerAddr::take(&table, a).expect("a place freed");
        drop((second, third));
        assert_eq!(table.open(a), 0);
        assert!(
            table.open.lock().unwrap().is_empty(),
            "no entry left behind"
        );
    }

    #[test]
    fn ipv6_clients_count_by_their_64_and_mapped_ipv4_as_ipv4() {
        let table = Arc::new(PerAddr::new(1));
        let one: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let same_64: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let other_64: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        let _held = PerAddr::take(&table, one).unwrap();
        assert!(PerAddr::take(&table, same_64).is_none());
        assert!(PerAddr::take(&table, other_64).is_some());
        let v4: IpAddr = "192.0.2.7".parse().unwrap();
        let mapped: IpAddr = "::ffff:192.0.2.7".parse().unwrap();
        let _v4 = PerAddr::take(&table, v4).unwrap();
        assert!(PerAddr::take(&table, mapped).is_none());
    }
}
