package idempotency

import (
	"context"
	"sync"

	"github.com/redis/go-redis/v9"
)

// waitHub multiplexes every waiter of one store over a single pub/sub
// connection: a channel is subscribed while at least one waiter waits on it.
//
// No wake-up may be lost. A waiter is told it is subscribed only once Redis
// has confirmed its SUBSCRIBE; the Guard re-reads the record after that, so a
// completion either precedes the re-read or is published to a confirmed
// subscriber. Confirmations are counted per channel, and SUBSCRIBE and
// UNSUBSCRIBE are sent under the hub's lock so the wire order is the order
// decided here: a confirmation of an earlier SUBSCRIBE, followed by an
// UNSUBSCRIBE still on its way, can never pass for a new waiter's.
// After a reconnect go-redis resubscribes and reports it as a confirmation;
// every waiter of that channel is then woken to re-read, as messages sent
// while the connection was down are gone.
type waitHub struct {
	c redis.UniversalClient

	mu     sync.Mutex
	ps     *redis.PubSub // nil until the first waiter
	chans  map[string]*waitChannel
	closed bool
	done   chan struct{} // closed when the dispatcher ends
}

type waitChannel struct {
	pending int // SUBSCRIBEs sent and not yet confirmed
	leaving int // UNSUBSCRIBEs sent and not yet confirmed
	waiters map[*redisSub]struct{}
}

type redisSub struct {
	h     *waitHub
	name  string
	c     chan struct{}
	ready chan struct{} // closed once the subscription is confirmed
	once  sync.Once
}

func newWaitHub(c redis.UniversalClient) *waitHub {
	return &waitHub{c: c, chans: make(map[string]*waitChannel)}
}

func (s *redisSub) C() <-chan struct{} { return s.c }

func (s *redisSub) Close() { s.once.Do(func() { s.h.leave(s) }) }

// subscribe returns once name is confirmed subscribed for the new waiter.
func (h *waitHub) subscribe(ctx context.Context, name string) (*redisSub, error) {
	sub := &redisSub{h: h, name: name, c: make(chan struct{}, 1), ready: make(chan struct{})}
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		return nil, redis.ErrClosed
	}
	if h.ps == nil {
		h.ps = h.c.Subscribe(context.WithoutCancel(ctx))
		h.done = make(chan struct{})
		go h.dispatch(h.ps.ChannelWithSubscriptions(redis.WithChannelSize(1024)), h.done)
	}
	ch := h.chans[name]
	if ch == nil {
		ch = &waitChannel{waiters: make(map[*redisSub]struct{})}
		h.chans[name] = ch
	}
	ch.waiters[sub] = struct{}{}
	if len(ch.waiters) == 1 {
		ch.pending++
		if err := h.ps.Subscribe(ctx, name); err != nil {
			// go-redis keeps the channel in its list even so; take it out,
			// or a reconnect would subscribe it for nobody.
			_ = h.ps.Unsubscribe(context.WithoutCancel(ctx), name)
			ch.pending--
			delete(ch.waiters, sub)
			h.forget(name, ch)
			h.mu.Unlock()
			return nil, err
		}
	} else if ch.pending == 0 {
		close(sub.ready)
	}
	h.mu.Unlock()

	select {
	case <-sub.ready:
		return sub, nil
	case <-ctx.Done():
		sub.Close()
		return nil, ctx.Err()
	}
}

// leave removes a waiter, unsubscribing its channel when it was the last.
func (h *waitHub) leave(s *redisSub) {
	h.mu.Lock()
	defer h.mu.Unlock()
	ch := h.chans[s.name]
	if ch == nil {
		return
	}
	delete(ch.waiters, s)
	if len(ch.waiters) == 0 && !h.closed {
		ch.leaving++
		if err := h.ps.Unsubscribe(context.Background(), s.name); err != nil {
			// go-redis dropped the channel from its list anyway, so a
			// reconnect will not restore it; no confirmation will come.
			ch.leaving--
		}
	}
	h.forget(s.name, ch)
}

// forget drops a channel's entry once nothing about it is outstanding.
func (h *waitHub) forget(name string, ch *waitChannel) {
	if len(ch.waiters) == 0 && ch.pending == 0 && ch.leaving == 0 {
		delete(h.chans, name)
	}
}

// dispatch turns pub/sub traffic into wake-ups until the PubSub is closed.
func (h *waitHub) dispatch(msgs <-chan any, done chan struct{}) {
	defer close(done)
	for m := range msgs {
		h.mu.Lock()
		switch m := m.(type) {
		case *redis.Message:
			if ch := h.chans[m.Channel]; ch != nil {
				wakeAll(ch)
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
				if ch.pending > 0 {
					break
				}
				for s := range ch.waiters {
					select {
					case <-s.ready:
						// Resubscribed after a reconnect: what was published
						// meanwhile is gone, so the waiter re-reads.
						wake(s)
					default:
						close(s.ready)
					}
				}
			case "unsubscribe", "sunsubscribe":
				if ch.leaving > 0 {
					ch.leaving--
				}
			}
			h.forget(m.Channel, ch)
		}
		h.mu.Unlock()
	}
}

func wakeAll(ch *waitChannel) {
	for s := range ch.waiters {
		wake(s)
	}
}

func wake(s *redisSub) {
	select {
	case s.c <- struct{}{}:
	default: // a wake-up is already pending
	}
}

func (h *waitHub) close() error {
	h.mu.Lock()
	h.closed = true
	ps, done := h.ps, h.done
	h.mu.Unlock()
	if ps == nil {
		return nil
	}
	err := ps.Close()
	<-done
	return err
}
