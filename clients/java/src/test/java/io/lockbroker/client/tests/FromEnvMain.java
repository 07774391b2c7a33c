package io.lockbroker.client.tests;

import io.lockbroker.client.Lease;
import io.lockbroker.client.LockBroker;
import java.time.Duration;

/**
 * A program for {@link ApiTests}: {@code LockBroker.fromEnv()} in a process whose environment
 * the test chose. With a key, acquires and releases it and prints "URL fence N"; with
 * {@code --url-only}, prints the URL.
 */
public final class FromEnvMain {
    private FromEnvMain() {
    }

    public static void main(String[] args) {
        try (LockBroker broker = LockBroker.fromEnv()) {
            if ("--url-only".equals(args[0])) {
                System.out.println(broker.url());
                return;
            }
            try (Lease lease = broker.acquire(args[0], Duration.ofSeconds(5), Duration.ZERO)) {
                System.out.println(broker.url() + " fence " + lease.fence());
            }
        }
    }
}
