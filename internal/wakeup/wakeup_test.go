package wakeup

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
)

func pending(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

func TestSignalCoalesces(t *testing.T) {
	s := NewSignal()
	assert.False(t, pending(s))
	s.Wake()
	s.Wake() // merged into the first: it must not block
	assert.True(t, pending(s))
	assert.False(t, pending(s), "two wake-ups while one was pending leave one")
}

func TestRegistry(t *testing.T) {
	var r Registry[string]
	a1, a2, b := r.Add("a"), r.Add("a"), r.Add("b")
	r.Wake("a")
	assert.True(t, pending(a1.C()))
	assert.True(t, pending(a2.C()))
	assert.False(t, pending(b.C()), "a wake-up of a reached b")

	a1.Close()
	a1.Close()
	r.Wake("a")
	assert.False(t, pending(a1.C()), "a closed subscription was woken")
	assert.True(t, pending(a2.C()))

	r.WakeAll()
	assert.True(t, pending(a2.C()))
	assert.True(t, pending(b.C()))

	a2.Close()
	b.Close()
	assert.Empty(t, r.subs, "closed subscriptions are kept")
}

// TestRegistryConcurrent subscribes, wakes and closes from many goroutines
// at once (run it with -race): every subscription open across a Wake of
// its record is woken.
func TestRegistryConcurrent(t *testing.T) {
	var r Registry[int]
	var wg sync.WaitGroup
	for i := range 50 {
		wg.Go(func() {
			for range 100 {
				s := r.Add(i % 5)
				r.Wake(i % 5)
				assert.True(t, pending(s.C()), "a Wake after Add did not reach the subscription")
				s.Close()
			}
		})
	}
	wg.Wait()
	assert.Empty(t, r.subs)
}
