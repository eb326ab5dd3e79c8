package idempotency

import (
	"context"
	"errors"
	"maps"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idempotency-go/idempotency/internal/wakeup"
)

// pubsub multiplexes every waiter of one store over pub/sub connections,
// one per node: the server itself on standalone Redis (SUBSCRIBE), each
// master on a cluster (SSUBSCRIBE: a sharded channel is served only by the
// master of its slot, and one SSUBSCRIBE may name channels of one slot
// only). Each connection is a hub.
//
// No wake-up may be lost. A waiter is told it is subscribed only once Redis
// has confirmed its subscription; the Guard re-reads the record after that,
// so a completion either precedes the re-read or is published to a
// confirmed subscriber. Whenever a subscription may have missed a message
// (its connection failed, or its slot moved to another master, which then
// drops the channel with an unasked SUNSUBSCRIBE), its waiters are
// subscribed again, on a fresh hub of the slot's current master, and woken
// once that is confirmed: they re-read, and the invariant holds again.
type pubsub struct {
	// locate names the node serving channel, and the client to subscribe
	// through.
	locate func(ctx context.Context, channel string) (node string, c redis.UniversalClient, err error)
	// reload refreshes the client's view of which node serves which slot.
	reload     func(ctx context.Context)
	sub, unsub func(ps *redis.PubSub, ctx context.Context, channels ...string) error

	mu     sync.Mutex
	hubs   map[string]*hub // by node
	closed bool
	quit   chan struct{}  // closed by close: stops re-subscribing
	wg     sync.WaitGroup // dispatchers and re-subscribers
}

// hubPing is how long a hub's connection may stay silent before it is
// pinged; silent for as long again, it counts as failed.
const hubPing = 3 * time.Second

// Re-subscribing waits rehomeBackoff, doubling up to 16 times that, between
// attempts. A channel that left a node because its slot moved avoids that
// node for its first rehomeAvoid attempts (0.75s), while the client's slot
// map catches up with the move; subscribing there would be refused, and
// retire the node's hub.
const (
	rehomeBackoff = 50 * time.Millisecond
	rehomeAvoid   = 5
)

var errHubFailing = errors.New("pub/sub connection keeps failing")

// newPubsub returns the pubsub of a standalone or Sentinel client: plain
// pub/sub on its one server.
func newPubsub(c redis.UniversalClient) *pubsub {
	return &pubsub{
		locate: func(context.Context, string) (string, redis.UniversalClient, error) { return "", c, nil },
		reload: func(context.Context) {},
		sub:    (*redis.PubSub).Subscribe,
		unsub:  (*redis.PubSub).Unsubscribe,
		hubs:   make(map[string]*hub),
		quit:   make(chan struct{}),
	}
}

// newShardedPubsub returns the pubsub of a cluster: sharded pub/sub on the
// master of each channel's slot.
func newShardedPubsub(cc *redis.ClusterClient) *pubsub {
	return &pubsub{
		locate: func(ctx context.Context, channel string) (string, redis.UniversalClient, error) {
			n, err := cc.MasterForKey(ctx, channel)
			if err != nil {
				return "", nil, err
			}
			return n.Options().Addr, n, nil
		},
		reload: cc.ReloadState,
		sub:    (*redis.PubSub).SSubscribe,
		unsub:  (*redis.PubSub).SUnsubscribe,
		hubs:   make(map[string]*hub),
		quit:   make(chan struct{}),
	}
}

// hub is one pub/sub connection: a channel is subscribed while at least
// one waiter waits on it. Confirmations are counted per channel, and
// (un)subscriptions are sent under the hub's lock so the wire order is the
// order decided here: a confirmation of an earlier SUBSCRIBE, followed by an
// UNSUBSCRIBE still on its way, can never pass for a new waiter's.
//
// A hub never recovers from a failure: a connection that failed may have
// missed messages, and go-redis's own resubscription sends every channel in
// one SSUBSCRIBE, which a cluster refuses when they span slots. On any
// error the hub retires and its waiters move to a fresh one.
type hub struct {
	w    *pubsub
	node string
	ps   *redis.PubSub

	mu    sync.Mutex
	chans map[string]*hubChannel // nil once retired
}

type hubChannel struct {
	pending int                    // SUBSCRIBEs sent and not yet confirmed
	leaving int                    // UNSUBSCRIBEs sent and not yet confirmed
	subs    map[*redisSub]struct{} // the subscriptions waiting on the channel
}

type redisSub struct {
	name  string
	c     wakeup.Signal
	ready chan struct{} // closed once the first subscription is confirmed

	// mu orders joining a hub against Close, so that a waiter that is
	// being moved to another hub is never left behind in it.
	mu     sync.Mutex
	hub    *hub
	closed bool
}

func (s *redisSub) C() <-chan struct{} { return s.c }

func (s *redisSub) Close() {
	s.mu.Lock()
	h := s.hub
	s.hub, s.closed = nil, true
	s.mu.Unlock()
	if h != nil {
		h.leave(s)
	}
}

// subscribe returns once name is confirmed subscribed for the new waiter.
func (w *pubsub) subscribe(ctx context.Context, name string) (*redisSub, error) {
	s := &redisSub{name: name, c: wakeup.NewSignal(), ready: make(chan struct{})}
	node, c, err := w.locate(ctx, name)
	if err == nil {
		err = w.place(ctx, s, node, c)
	}
	if err != nil {
		return nil, err
	}
	select {
	case <-s.ready:
		return s, nil
	case <-ctx.Done():
		s.Close()
		return nil, ctx.Err()
	}
}

// place adds s to the hub of node, made on c if there is none. It does
// nothing to a closed waiter.
func (w *pubsub) place(ctx context.Context, s *redisSub, node string, c redis.UniversalClient) error {
	// A hub that retired between being found and being joined is replaced
	// once; a second one failing as fast means the node is failing.
	for range 2 {
		h, err := w.hubFor(node, c)
		if err != nil {
			return err
		}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			return nil
		}
		joined, err := h.join(ctx, s)
		if joined {
			s.hub = h
		}
		s.mu.Unlock()
		if joined || err != nil {
			return err
		}
		w.drop(h)
	}
	return errHubFailing
}

// hubFor returns the live hub of node, starting one on c if there is none.
func (w *pubsub) hubFor(node string, c redis.UniversalClient) (*hub, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return nil, redis.ErrClosed
	}
	if h := w.hubs[node]; h != nil {
		return h, nil
	}
	h := &hub{w: w, node: node, ps: c.Subscribe(context.Background()), chans: make(map[string]*hubChannel)}
	w.hubs[node] = h
	w.wg.Add(1)
	go h.dispatch()
	return h, nil
}

// drop forgets h as its node's hub.
func (w *pubsub) drop(h *hub) {
	w.mu.Lock()
	if w.hubs[h.node] == h {
		delete(w.hubs, h.node)
	}
	w.mu.Unlock()
}

// rehome subscribes subs, the waiters of channel name, on a fresh hub of the
// channel's current master, retrying until it succeeds or they close; the
// confirmation wakes them. Until then they rely on their re-check timers.
// avoid, when set, is the node the channel's slot just left.
func (w *pubsub) rehome(name string, subs []*redisSub, avoid string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return
	}
	w.wg.Add(1)
	go func() {
		defer w.wg.Done()
		ctx := context.Background()
		for attempt := 0; len(subs) > 0; attempt++ {
			if attempt > 0 {
				select {
				case <-time.After(rehomeBackoff << min(attempt-1, 4)):
				case <-w.quit:
					return
				}
			}
			w.reload(ctx)
			node, c, err := w.locate(ctx, name)
			if err != nil || (avoid != "" && node == avoid && attempt < rehomeAvoid) {
				continue
			}
			subs = slices.DeleteFunc(subs, func(s *redisSub) bool { return w.place(ctx, s, node, c) == nil })
		}
	}()
}

// join adds s to its channel's waiters, subscribing the channel if s is its
// first. It reports false when the hub has retired, or when sending failed,
// which retires it.
func (h *hub) join(ctx context.Context, s *redisSub) (bool, error) {
	h.mu.Lock()
	if h.chans == nil {
		h.mu.Unlock()
		return false, nil
	}
	ch := h.chans[s.name]
	if ch == nil {
		ch = &hubChannel{subs: make(map[*redisSub]struct{})}
		h.chans[s.name] = ch
	}
	ch.subs[s] = struct{}{}
	var err error
	switch {
	case len(ch.subs) == 1:
		ch.pending++
		// Not cancelled with ctx: go-redis drops a connection whose write
		// was interrupted, which would retire the hub for every waiter.
		if err = h.w.sub(h.ps, context.WithoutCancel(ctx), s.name); err != nil {
			ch.pending--
			delete(ch.subs, s)
			h.forget(s.name, ch)
		}
	case ch.pending == 0:
		s.confirm()
	}
	h.mu.Unlock()
	if err != nil {
		h.retire()
		return false, err
	}
	return true, nil
}

// leave removes a waiter, unsubscribing its channel when it was the last.
func (h *hub) leave(s *redisSub) {
	h.mu.Lock()
	ch := h.chans[s.name]
	if ch == nil {
		h.mu.Unlock() // retired
		return
	}
	if _, ok := ch.subs[s]; !ok {
		h.mu.Unlock() // moved to another hub
		return
	}
	delete(ch.subs, s)
	var err error
	if len(ch.subs) == 0 {
		ch.leaving++
		if err = h.w.unsub(h.ps, context.Background(), s.name); err != nil {
			ch.leaving--
		}
	}
	h.forget(s.name, ch)
	h.mu.Unlock()
	if err != nil {
		h.retire()
	}
}

// forget drops a channel's entry once nothing about it is outstanding.
func (h *hub) forget(name string, ch *hubChannel) {
	if len(ch.subs) == 0 && ch.pending == 0 && ch.leaving == 0 {
		delete(h.chans, name)
	}
}

// dispatch turns pub/sub traffic into wake-ups until the connection fails
// or the hub retires.
func (h *hub) dispatch() {
	defer h.w.wg.Done()
	defer h.retire()
	ctx := context.Background()
	pinged := false
	for {
		m, err := h.ps.ReceiveTimeout(ctx, hubPing)
		if err != nil {
			var ne net.Error
			if pinged || !errors.As(err, &ne) || !ne.Timeout() || h.ps.Ping(ctx) != nil {
				return
			}
			pinged = true
			continue
		}
		pinged = false
		h.handle(m)
	}
}

func (h *hub) handle(m any) {
	var moved []*redisSub
	var name string
	h.mu.Lock()
	switch m := m.(type) {
	case *redis.Message:
		if ch := h.chans[m.Channel]; ch != nil {
			for s := range ch.subs {
				s.c.Wake()
			}
		}
	case *redis.Subscription:
		ch := h.chans[m.Channel]
		if ch == nil {
			break
		}
		switch m.Kind {
		case "subscribe", "ssubscribe":
			if ch.pending > 0 {
				ch.pending--
			}
			if ch.pending == 0 {
				for s := range ch.subs {
					s.confirm()
				}
			}
		case "unsubscribe", "sunsubscribe":
			if ch.leaving > 0 {
				ch.leaving--
				break
			}
			// Unasked: the node no longer serves the channel's slot.
			name, moved = m.Channel, slices.Collect(maps.Keys(ch.subs))
			clear(ch.subs)
		}
		h.forget(m.Channel, ch)
	}
	h.mu.Unlock()
	if len(moved) > 0 {
		h.w.rehome(name, moved, h.node)
	}
}

// retire closes the hub's connection and moves its waiters to fresh hubs.
func (h *hub) retire() error {
	h.mu.Lock()
	chans := h.chans
	h.chans = nil
	h.mu.Unlock()
	if chans == nil {
		return nil
	}
	h.w.drop(h)
	err := h.ps.Close()
	for name, ch := range chans {
		if len(ch.subs) > 0 {
			h.w.rehome(name, slices.Collect(maps.Keys(ch.subs)), "")
		}
	}
	return err
}

// confirm tells s that its subscription is confirmed: a new waiter
// returns from subscribe; one that was subscribed before has missed what
// was published meanwhile, so it re-reads.
func (s *redisSub) confirm() {
	select {
	case <-s.ready:
		s.c.Wake()
	default:
		close(s.ready)
	}
}

// close retires every hub; waiters still waiting fall back to their
// re-check timers.
func (w *pubsub) close() error {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return nil
	}
	w.closed = true
	close(w.quit)
	hubs := slices.Collect(maps.Values(w.hubs))
	w.mu.Unlock()
	var errs []error
	for _, h := range hubs {
		errs = append(errs, h.retire())
	}
	w.wg.Wait()
	return errors.Join(errs...)
}
