package io.lockbroker.client.tests;

import io.lockbroker.client.Lease;
import io.lockbroker.client.LockBroker;
import io.lockbroker.client.Session;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;

/**
 * A program for {@link SessionTests}: a node that opens a session, takes keys under it and
 * holds them, in a JVM of its own that the test kills (SIGKILL) to stop its keep-alives the way
 * a dying node does. Arguments: {@code URL TTL_MS LOCK_DELAY_MS KEY...}; prints
 * {@code held FENCE...} once every key is held. Bounded: it closes the session and exits after
 * 60 s if nobody killed it.
 */
public final class SessionHolderMain {
    private SessionHolderMain() {
    }

    public static void main(String[] args) throws InterruptedException {
        try (LockBroker broker = LockBroker.create(args[0]);
                Session session = broker.openSession(Duration.ofMillis(Long.parseLong(args[1])),
                        Duration.ofMillis(Long.parseLong(args[2])))) {
            List<String> fences = new ArrayList<>();
            for (int i = 3; i < args.length; i++) {
                Lease lease = session.acquire(args[i], Duration.ofSeconds(10));
                fences.add(String.valueOf(lease.fence()));
            }
            System.out.println("held " + String.join(" ", fences));
            System.out.flush();
            Thread.sleep(60_000);
        }
    }
}
