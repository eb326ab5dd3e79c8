// Package wakeup holds the subscriptions through which stores wake the
// callers waiting on a record.
//
// A wake-up says only that the record may have changed: the waiter re-reads
// it. So wake-ups coalesce: a subscription holds at most one pending
// wake-up, one that comes while another is pending is merged into it, and
// none is lost for a waiter that is not reading when it comes.
package wakeup

import "sync"

// Signal is a channel of coalescing wake-ups. Make it with NewSignal.
type Signal chan struct{}

// NewSignal returns a Signal with no wake-up pending.
func NewSignal() Signal { return make(Signal, 1) }

// Wake leaves a wake-up pending on s; it never blocks.
func (s Signal) Wake() {
	select {
	case s <- struct{}{}:
	default: // one is pending already: the waiter will re-read anyway
	}
}

// Registry is the subscriptions of a store, by the record they wait on
// (whatever K names a record by). Its zero value is empty and ready to use;
// it is safe for concurrent use.
type Registry[K comparable] struct {
	mu   sync.Mutex
	subs map[K]map[*Subscription[K]]struct{}
}

// Subscription receives the wake-ups of one record until it is closed. It
// implements idempotency.Subscription.
type Subscription[K comparable] struct {
	r    *Registry[K]
	k    K
	c    Signal
	once sync.Once
}

// Add subscribes to k. Every Wake of k (or WakeAll) that begins after Add
// returns reaches the subscription.
func (r *Registry[K]) Add(k K) *Subscription[K] {
	s := &Subscription[K]{r: r, k: k, c: NewSignal()}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.subs == nil {
		r.subs = make(map[K]map[*Subscription[K]]struct{})
	}
	if r.subs[k] == nil {
		r.subs[k] = make(map[*Subscription[K]]struct{})
	}
	r.subs[k][s] = struct{}{}
	return s
}

// Wake wakes every subscription to k.
func (r *Registry[K]) Wake(k K) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for s := range r.subs[k] {
		s.c.Wake()
	}
}

// WakeAll wakes every subscription, as a store does when it may have
// missed the notifications of any record.
func (r *Registry[K]) WakeAll() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, subs := range r.subs {
		for s := range subs {
			s.c.Wake()
		}
	}
}

// C receives a value after the record may have changed.
func (s *Subscription[K]) C() <-chan struct{} { return s.c }

// Close ends the subscription; it may be called more than once.
func (s *Subscription[K]) Close() {
	s.once.Do(func() {
		r := s.r
		r.mu.Lock()
		defer r.mu.Unlock()
		delete(r.subs[s.k], s)
		if len(r.subs[s.k]) == 0 {
			delete(r.subs, s.k)
		}
	})
}
