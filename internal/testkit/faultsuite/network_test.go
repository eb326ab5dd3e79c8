package faultsuite

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"testing"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/rs/zerolog"
)

// network is every instance's way to the servers: one Toxiproxy proxy per
// instance and server node, so that a fault can hit every instance or cut
// one off. It counts the faults it injects, by kind. Its methods are called
// by one goroutine at a time.
type network struct {
	t *testing.T
	// proxies[i][upstream] carries instance i's connections to upstream.
	proxies []map[string]*toxiproxy.Proxy
	seq     int
	faults  map[string]int
}

// newNetwork starts a proxy for each of instances to each upstream; they
// stop when t ends.
func newNetwork(t *testing.T, instances int, upstreams []string) *network {
	t.Helper()
	api := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())
	n := &network{t: t, faults: make(map[string]int)}
	for i := range instances {
		row := make(map[string]*toxiproxy.Proxy)
		for _, up := range upstreams {
			p := toxiproxy.NewProxy(api, fmt.Sprintf("instance%d-%s", i, up), "127.0.0.1:0", up)
			if err := p.Start(); err != nil {
				t.Fatalf("starting the proxy to %s: %v", up, err)
			}
			t.Cleanup(p.Stop)
			row[up] = p
		}
		n.proxies = append(n.proxies, row)
	}
	return n
}

// dial connects instance i to addr, one of the upstreams, through its proxy.
func (n *network) dial(ctx context.Context, i int, addr string) (net.Conn, error) {
	p, ok := n.proxies[i][addr]
	if !ok {
		return nil, fmt.Errorf("faultsuite: no proxy to %s", addr)
	}
	var d net.Dialer
	return d.DialContext(ctx, "tcp", p.Listen)
}

// addr is the address instance i dials for upstream.
func (n *network) addr(i int, upstream string) string {
	return n.proxies[i][upstream].Listen
}

// toxic is one of Toxiproxy's toxics, as its API takes it.
type toxic struct {
	Name       string           `json:"name"`
	Type       string           `json:"type"`
	Stream     string           `json:"stream"` // "upstream" (to the server) or "downstream"
	Toxicity   float32          `json:"toxicity"`
	Attributes map[string]int64 `json:"attributes"`
}

// inject adds tx, counted as a fault of kind, to every proxy of the given
// instances (every instance when none is given), connections already open
// included. The function it returns removes it again.
func (n *network) inject(kind string, tx toxic, instances ...int) (remove func()) {
	if len(instances) == 0 {
		for i := range n.proxies {
			instances = append(instances, i)
		}
	}
	n.seq++
	tx.Name = fmt.Sprintf("%s-%s-%d", tx.Type, tx.Stream, n.seq)
	if tx.Toxicity == 0 {
		tx.Toxicity = 1
	}
	body, _ := json.Marshal(tx) // strings and numbers: it cannot fail
	var added []*toxiproxy.Proxy
	for _, i := range instances {
		for _, p := range n.proxies[i] {
			if _, err := p.Toxics.AddToxicJson(bytes.NewReader(body)); err != nil {
				n.t.Errorf("adding %s to %s: %v", body, p.Name, err)
				continue
			}
			added = append(added, p)
			n.faults[kind]++
		}
	}
	return func() {
		for _, p := range added {
			if err := p.Toxics.RemoveToxic(context.Background(), tx.Name); err != nil {
				n.t.Errorf("removing %s from %s: %v", tx.Name, p.Name, err)
			}
		}
	}
}
