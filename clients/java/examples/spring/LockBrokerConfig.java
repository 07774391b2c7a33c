package com.example.orders;

// A Spring example, not compiled by build.sh (Spring is not on its class path): copy it into a
// Spring Boot application that depends on io.lockbroker:lockbroker-client (see ../../pom.xml).

import io.lockbroker.client.LockBroker;
import org.springframework.beans.factory.annotation.Value;
import org.springframework.context.annotation.Bean;
import org.springframework.context.annotation.Configuration;

/**
 * One {@link LockBroker} for the whole application (it is thread-safe). Spring calls
 * {@code close()} at shutdown, which stops the background renewals and releases the leases
 * still open, so a redeployed Tomcat does not keep its locks until their ttl runs out.
 *
 * <p>The properties bind from the environment as {@code LockBroker.fromEnv()} reads it:
 * {@code LOCKBROKER_URL} and {@code LOCKBROKER_AUTH_TOKEN} (the bearer token). Not
 * {@code lockbroker.token}: Spring would fill that from {@code LOCKBROKER_TOKEN}, which under
 * {@code lockbroker run} is the token of the lock the command runs under, not a credential.
 */
@Configuration
public class LockBrokerConfig {
    @Bean(destroyMethod = "close")
    public LockBroker lockBroker(
            @Value("${lockbroker.url:http://127.0.0.1:8080}") String url,
            @Value("${lockbroker.auth.token:}") String token,
            @Value("${spring.application.name:app}") String appName) {
        LockBroker.Builder builder = LockBroker.builder().url(url).owner(appName);
        if (!token.isEmpty()) {
            builder.authToken(token);
        }
        return builder.build();
    }
}
