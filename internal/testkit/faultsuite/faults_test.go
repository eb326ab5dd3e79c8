package faultsuite

import (
	"context"
	"math/rand/v2"
	"time"
)

// latency delays every chunk, both ways, by 0 to 60ms: round trips of up
// to 120ms, against renewals every 300ms.
var latency = scenario{name: "latency", faults: func(ctx context.Context, n *network) {
	for _, stream := range []string{"upstream", "downstream"} {
		defer n.inject("latency", toxic{Type: "latency", Stream: stream, Attributes: map[string]int64{"latency": 30, "jitter": 30}})()
	}
	<-ctx.Done()
}}

// reset breaks connections every 100 to 250ms, on half of them each time:
// either the next request a connection carries is dropped and the
// connection closed (the server never saw it), or the replies are cut
// after a few bytes (the server applied the request). Claims, completions,
// renewals and the wake-up connections are all hit.
var reset = scenario{name: "reset", faults: func(ctx context.Context, n *network) {
	for sleep(ctx, 100*time.Millisecond+rand.N(150*time.Millisecond)) {
		var remove func()
		if rand.IntN(2) == 0 {
			remove = n.inject("reset", toxic{Type: "reset_peer", Stream: "upstream", Toxicity: 0.5})
		} else {
			remove = n.inject("limit_data", toxic{Type: "limit_data", Stream: "downstream", Toxicity: 0.5,
				Attributes: map[string]int64{"bytes": 1 + rand.Int64N(200)}})
		}
		sleep(ctx, 50*time.Millisecond)
		remove()
	}
}}

// timeout swallows every reply for 200 to 500ms, then closes the
// connections that carried them: the server ran the script or the
// statement, its caller never hears of it. Wake-ups are swallowed too.
var timeout = scenario{name: "timeout", faults: func(ctx context.Context, n *network) {
	for sleep(ctx, 200*time.Millisecond+rand.N(200*time.Millisecond)) {
		remove := n.inject("timeout", toxic{Type: "timeout", Stream: "downstream", Attributes: map[string]int64{"timeout": 0}})
		sleep(ctx, 200*time.Millisecond+rand.N(300*time.Millisecond))
		remove()
	}
}}

// bandwidth limits every connection to 64 KB/s each way and slices what
// it carries into chunks of 8 to 24 bytes, 200µs apart, with responses of
// 2 KiB: every reply arrives in pieces.
var bandwidth = scenario{name: "bandwidth", bodySize: 2048, faults: func(ctx context.Context, n *network) {
	for _, stream := range []string{"upstream", "downstream"} {
		defer n.inject("bandwidth", toxic{Type: "bandwidth", Stream: stream, Attributes: map[string]int64{"rate": 64}})()
		defer n.inject("slicer", toxic{Type: "slicer", Stream: stream,
			Attributes: map[string]int64{"average_size": 16, "size_variation": 8, "delay": 200}})()
	}
	<-ctx.Done()
}}

// partition cuts instance 0 off the servers for twice the lease (nothing
// passes, nothing is closed), then heals, closing its connections. The
// other instances go on with the same keys, and take over its records.
var partition = scenario{name: "partition", isolates: true, loadFor: 3 * time.Second, faults: func(ctx context.Context, n *network) {
	if !sleep(ctx, 300*time.Millisecond) {
		return
	}
	up := n.inject("partition", toxic{Type: "timeout", Stream: "upstream", Attributes: map[string]int64{"timeout": 0}}, 0)
	down := n.inject("partition", toxic{Type: "timeout", Stream: "downstream", Attributes: map[string]int64{"timeout": 0}}, 0)
	sleep(ctx, 2*lease)
	up()
	down()
	<-ctx.Done()
}}
